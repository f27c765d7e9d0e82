"""Load bench: drives any OpenAI-compatible server over HTTP and reports TTFT, TPOT and stalls.

Modules: `workload` (what to send), `client` (streams it), `report` (the maths), `promcheck` (the
server's own histograms), `trace` (step_trace JSONL), `plot`, `server` and `sweep` (one server per
prefill_chunk setting). Nothing here imports the engine.
"""
