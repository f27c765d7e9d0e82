"""Disaggregated prefill: a prefill instance runs prompts, a decode instance (the front) serves streams.

`mixserve serve --role prefill --kv-peer HOST:PORT` and `mixserve serve --role decode --kv-peer HOST:PORT`
(role both, the default, is one instance doing both). Modules, one job each:
- link.py: the KV link, torch.distributed point-to-point (gloo), one group per direction, and failure;
- kv_blocks.py: a prompt's full KV blocks as one tensor (gather, scatter into mapped ids), layout check;
- prefill_side.py: PrefillEngine, runs the link's prompts to their first token, ships their blocks;
- decode_side.py: DecodeEngine, sends prompts, imports the blocks through the prefix cache, continues;
- roles.py: which engine `serve` builds for a role, and the checks on the keys.
docs/disaggregated-prefill.md says when it pays.
"""
