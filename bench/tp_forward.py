"""Forward time at tensor_parallel_size 1 and 2 on the default model: a 256-token prefill and a decode
batch of 32, each the median of REPEATS (run under `flock /tmp/mixserve-bench.lock`)."""

from __future__ import annotations

import argparse
import statistics
import time

from mixserve import LLM
from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.engine.threads import bind_threads

REPEATS = 7


def batches(block_size: int) -> dict[str, ForwardBatch]:
    per_seq = 512 // block_size // 32  # 32 sequences of 16 tokens of context, disjoint blocks
    prompt = [11 + i % 900 for i in range(256)]
    prefill = ForwardBatch([ForwardSeq("p", prompt, 0, list(range(256 // block_size)))])
    tables = [list(range(64 + i * per_seq, 64 + (i + 1) * per_seq)) for i in range(32)]
    decode = ForwardBatch([ForwardSeq(f"d{i}", [42], 15, t) for i, t in enumerate(tables)])
    return {"prefill 256": prefill, "decode 32": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1,2")
    args = parser.parse_args()
    for size in [int(s) for s in args.sizes.split(",")]:
        llm = LLM(None, tensor_parallel_size=size, num_blocks=600, block_size=16, dtype="float32")
        runner = llm.engine.runner
        if llm.engine.num_threads >= 2:  # as the engine's first step would (tensor parallel pins its own)
            bind_threads(llm.engine.num_threads)
        for name, batch in batches(16).items():
            runner.forward(batch)  # warm-up
            times = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                runner.forward(batch)
                times.append(time.perf_counter() - start)
            print(f"tensor_parallel_size={size} {name}: median {1000 * statistics.median(times):.1f} ms "
                  f"(min {1000 * min(times):.1f})", flush=True)
        if size > 1:
            runner.close()
        del llm


if __name__ == "__main__":
    main()
