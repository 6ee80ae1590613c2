// A fake CUDA runtime for a CPU-only torch: the dry run's FakeTensorMode creates "cuda"
// tensors without memory, and autograd asks the device's guard for streams and events and
// ATen's CUDA hooks whether CUDA is the accelerator. On a CPU build neither is registered,
// so backward over fake CUDA tensors aborts. This library registers both: a device guard
// whose streams, events and synchronisations are no-ops, and hooks that report CUDA as
// built (torch.cuda.is_available() stays False: nothing real can run on it).
//
// Loaded by megazero.dryrun.fake_cuda before torch is imported (ATen reads its CUDA hooks
// once), via dlopen or LD_PRELOAD; never on a torch built with CUDA.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

constexpr DeviceIndex kDevices = 8;
thread_local DeviceIndex current = 0;

Device cuda(DeviceIndex i) { return Device(DeviceType::CUDA, i < 0 ? current : i); }
Stream default_stream(DeviceIndex i) { return Stream(Stream::DEFAULT, cuda(i)); }

struct FakeCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old = cuda(current);
    setDevice(d);
    return old;
  }
  Device getDevice() const override { return cuda(current); }
  void setDevice(Device d) const override {
    if (d.index() >= 0) current = d.index();
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0) current = d.index();
  }
  Stream getStream(Device d) const noexcept override { return default_stream(d.index()); }
  Stream getDefaultStream(Device d) const override { return default_stream(d.index()); }
  Stream getNewStream(Device d, int) const override { return default_stream(d.index()); }
  Stream getStreamFromGlobalPool(Device d, bool) const override {
    return default_stream(d.index());
  }
  Stream exchangeStream(Stream s) const noexcept override { return default_stream(s.device_index()); }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  DeviceIndex deviceCount() const noexcept override { return kDevices; }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
};
}  // namespace

namespace at {
struct MegazeroFakeCUDAHooks : public CUDAHooksInterface {
  explicit MegazeroFakeCUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return kDevices; }
  DeviceIndex getCurrentDevice() const override { return current; }
  void init() const override {}
};
namespace detail {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, at::MegazeroFakeCUDAHooks)
}  // namespace detail
}  // namespace at

// The guard registers when the library is loaded; returns 1 when it is in place.
static bool install_guard() {
  if (c10::impl::hasDeviceGuardImpl(DeviceType::CUDA)) return false;
  static FakeCudaGuard guard;
  static c10::impl::DeviceGuardImplRegistrar registrar(DeviceType::CUDA, &guard);
  return true;
}
static const bool installed = install_guard();

extern "C" int megazero_fake_cuda_installed() { return installed ? 1 : 0; }
