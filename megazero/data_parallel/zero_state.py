"""Checkpoint state of the flat-buffer ZeRO optimizers (stages 0-2; stage 3 extends it).

Each rank saves its partition as per-parameter fragments (``[param_start, param_end)`` of each
parameter's flat elements: fp32 main values and optimizer states), so a checkpoint can be read
back at another dp size or stage (``fragment_reader``) as well as at its own layout.
"""

from __future__ import annotations

from megazero.data_parallel.params import find_fragment


class ZeroCheckpointState:
    """Mixin of ``ZeroOptimizer``: uses its layout, segment views, rule, scaler and flags."""

    def sharded_state_dict(self) -> dict:
        """This rank's optimizer state as per-parameter fragments (layout-independent)."""
        fragments = {}
        for seg, view in zip(self.layout.segments, self._views):
            entry = {"param_start": seg.param_start, "param_end": seg.param_end,
                     "main": view.main.clone()}
            for k in self.rule.state_names:
                entry[k] = view.state[k].clone()
            fragments.setdefault(seg.name, []).append(entry)
        return {"zero_stage": self.stage, "step": self.step_count,
                "scaler": self.scaler.state_dict(), "fragments": fragments,
                "state_names": list(self.rule.state_names)}

    def load_sharded_state_dict(self, state: dict, fragment_reader=None) -> None:
        """Load fragments saved by ``sharded_state_dict`` (any dp layout via the reader)."""
        self.step_count = int(state["step"])
        self.scaler.load_state_dict(state["scaler"])
        frags = state.get("fragments", {})
        for seg, view in zip(self.layout.segments, self._views):
            if fragment_reader is not None:
                values = fragment_reader(seg.name, seg.param_start, seg.param_end)
            else:
                values = find_fragment(frags, seg)
            view.main.copy_(values["main"])
            for k in self.rule.state_names:
                view.state[k].copy_(values[k])
            if view.model_out is not None:
                view.model_out.copy_(view.main)
        if self.offload:
            self._params_from_host()
        if self.shard:
            self._all_gather_params()

    def reload_model_params(self) -> None:
        """Refresh fp32 main values from the (just loaded) model parameters."""
        if self.offload:
            for bucket, main in zip(self.layout.buckets, self.main_chunks):
                main.copy_(self._owned_model_chunk(bucket))
            return
        for view in self._views:
            if view.model_out is not None:
                view.main.copy_(view.model_out)
