"""The all-gather of updated parameters over the dp group (ZeRO 1-2), overlapped with the next
forward (``--overlap-param-gather``, the default).

After the step each dp rank holds the updated values of its owned chunk of every bucket; the
all-gather gives every rank the whole bucket again. Without overlap the step waits for all of
them. With overlap the step posts them asynchronously, in forward order (the layout's buckets
are in backward order, so the last bucket first), and returns; a module's forward pre-hook
waits only for the buckets holding the parameters it uses, so the gathers of later layers run
while earlier ones compute.

Which modules use which parameters comes from a *unit policy* (``zero3_units``: module path
-> the modules that need its parameters, e.g. GPT-2's tied output layer needs the embedding's
weight). Without one (a model megazero does not know, ``Engine``) the step waits for the
gathers itself, so parameters read anywhere are current. Parameters outside every unit are
waited for when their chunk's forward starts. Anything that reads parameters outside a
forward calls ``wait_all`` (the optimizer does so before it loads or zeroes gradients,
``pretrain`` after training, a model's ``state_dict`` through a hook).
"""

from __future__ import annotations

from megazero.data_parallel.layout import FlatLayout
from megazero.distributed import comm


class ParamGather:
    """Posts and completes the all-gathers of ``params`` (a ``FlatParams``) over ``dp_group``;
    ``hooks`` on: pre-hooks on ``model_chunks``' modules wait as described above."""

    def __init__(self, layout: FlatLayout, params, dp_group, model_chunks, unit_policy,
                 overlap: bool):
        self.layout, self.params, self.dp_group = layout, params, dp_group
        self.overlap = overlap and model_chunks is not None and unit_policy is not None
        self.pending: dict[int, object] = {}  # bucket index -> work of its all-gather
        if self.overlap:
            self._install(model_chunks, unit_policy)

    def _install(self, model_chunks, unit_policy) -> None:
        bucket_of = {id(pr.param): pr.bucket for pr in self.layout.ranges.values()}
        for chunk in model_chunks:
            mine = {bucket_of[id(p)] for p in chunk.parameters() if id(p) in bucket_of}
            covered: set[int] = set()
            for path, users in unit_policy(chunk):
                buckets = sorted({bucket_of[id(p)] for p in chunk.get_submodule(path)
                                  .parameters() if id(p) in bucket_of})
                covered.update(buckets)
                for mod in users:
                    mod.register_forward_pre_hook(lambda m, a, b=buckets: self.wait(b))
            first = sorted(mine - covered)
            chunk.register_forward_pre_hook(lambda m, a, b=first: self.wait(b))
            # whatever no module waited for (unused parameters) is complete after the forward
            chunk.register_forward_hook(lambda m, a, o: self.wait_all())
            chunk.register_state_dict_pre_hook(lambda *a, **k: self.wait_all())

    def start(self) -> None:
        """All-gather every replicated bucket from its owned chunks (just updated)."""
        self.wait_all()
        works = {}
        for bucket in reversed(self.params.replicated_buckets()):  # forward order
            works[bucket.index] = comm.all_gather_into(
                self.params.full_bucket(bucket), self.params.owned_chunk(bucket),
                self.dp_group, async_op=True)
        self.pending = {b: w for b, w in works.items() if w is not None}
        if not self.overlap:
            self.wait_all()

    def wait(self, buckets) -> None:
        for b in buckets:
            work = self.pending.pop(b, None)
            if work is not None:
                work.wait()

    def wait_all(self) -> None:
        """Complete every gather in flight (in the order they were posted)."""
        pending, self.pending = self.pending, {}
        for work in pending.values():
            work.wait()
