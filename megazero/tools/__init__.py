"""Command-line tools, each run as ``python -m megazero.tools.<name>``.

* ``pipeline_trace``: turn a ``--pipeline-trace`` JSON into a Chrome trace and a PNG timeline,
  and report the measured pipeline bubble per stage.
* ``zero_to_fp32``: consolidate a (ZeRO-sharded, tp/pp-split) checkpoint into one fp32 state
  dict.
* ``checkpoint``: inspect, convert between layouts, import/export Hugging Face GPT-2.
"""
