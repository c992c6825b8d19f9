"""vLLM CPU as a bench/peers.py contender, run by the vLLM venv's own python (`make peers-vllm`).

It loads the model once, says so on stdout as one marked JSON line, then answers each request
line (`{"prompts": [[token ids], ...], "max_tokens": n}`) with one marked line holding the wall
seconds of that `LLM.generate` call (prefill included) and each prompt's generated token ids.
Greedy, eager (no graph capture: NOTES.md section 8). Imports nothing of corpusgen.
Usage: .peers/vllm-venv/bin/python bench/_vllm_worker.py --model DIR [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a Hugging Face directory")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args()
    # vLLM CPU binds its OpenMP threads to these cores; the KV cache space is in GiB.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=1024, disable_log_stats=True)
    reply({"ready": True, "vllm": vllm.__version__, "torch": torch.__version__,
           "load_seconds": round(time.perf_counter() - started, 1)})
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        reply({"seconds": seconds,
               "tokens": [list(output.outputs[0].token_ids) for output in outputs]})


MARK = "peers-json "  # vLLM logs to stdout too: the reader keeps only lines with this mark


def reply(message: dict) -> None:
    """One marked JSON line on stdout."""
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
