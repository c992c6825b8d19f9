"""Runs one model at static shapes: pads every call to a grid point, owns its KV cache, and
counts the distinct shapes (and compiles) it executes, so "no new shape after warm-up" is a
checkable fact, not a hope.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from time import perf_counter

import torch

from generation import device as devices
from generation import kernels
from generation.graphs import GraphedForward, graph_capture
from generation.model import CausalLM, KVCache, fold_queries_where_exact
from generation.packing import bf16_linears_for, decode_row_counts, target_linears_for
from generation.phase import prefilling
from schemas import BucketGrid
from schemas.engine import CATCH_UP_WIDTHS

WARM_CALLS = 3  # decode calls per shape in warm-up, the first one's set-up included


def bucket(sizes: list[int], needed: int) -> int:
    """The smallest grid size >= needed."""
    index = bisect_left(sizes, needed)
    if index == len(sizes):
        raise ValueError(f"{needed} exceeds the largest bucket {sizes[-1]}")
    return sizes[index]


def _raise_recompile_limit(grid: BucketGrid) -> None:
    """Make room for one graph per grid shape of this runner. dynamo keeps at most
    `recompile_limit` graphs per code object, shared by every model of a class, and past it
    silently runs eager: a real grid has far more shapes than its default of 8."""
    import torch._dynamo.config as dynamo

    decode_widths = 2 + len(grid.draft_lengths) + len(CATCH_UP_WIDTHS)  # 1, K + 1, catch-up
    shapes = len(grid.prompt_lengths) + len(grid.batch_sizes) * len(grid.cache_lengths) * (
        decode_widths
    )
    dynamo.recompile_limit += shapes
    dynamo.accumulated_recompile_limit = max(
        dynamo.accumulated_recompile_limit, dynamo.recompile_limit
    )


def compiled_for_widths(compiled, eager, widths: frozenset[int]):
    """A forward that runs `compiled` for decode steps `widths` tokens wide and `eager` for
    prefills and wider steps, so only the shapes run every token pay a compile."""

    def forward(cache, **inputs) -> torch.Tensor:
        every_token = inputs["attend_len"] > 0 and inputs["tokens"].shape[1] in widths
        return (compiled if every_token else eager)(cache=cache, **inputs)

    return forward


def compile_for_this_cpu(graph_module, example_inputs):
    """Inductor's compile, with the vector width it picks for CPU code (from the CPU and
    ATEN_CPU_CAPABILITY) named in its config. Its on-disk graph cache keys on the config but
    not on that pick, so a graph cached by an AVX-512 process and loaded under AVX2 caps ran
    16-lane code built as 8-lane, reading out of bounds; named, the width is in the key."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    simdlen = config.cpp.simdlen  # a user's explicit choice is in the key already
    with config.patch({"cpp.simdlen": pick_vec_isa().bit_width() if simdlen is None else simdlen}):
        return compile_fx(graph_module, example_inputs)


def distinct_prompts(prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Each distinct prompt, in first-seen order, with its indices in `prompts`."""
    indices: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        indices.setdefault(tuple(prompt), []).append(i)
    return indices


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        grid: BucketGrid,
        device: torch.device,
        dtype: torch.dtype,
        compile_model: bool = False,
        hpu_graphs: bool = True,
        cuda_graphs: bool = False,
        exact_rows: bool = False,
        compiled_widths: frozenset[int] | None = None,
    ):
        """exact_rows: a target's runner, whose float linears must round a row the same in
        every decode call (packing.target_linears_for); a draft only proposes, and keeps the
        fastest kernels. compiled_widths: with compile_model, compile only decode forwards of
        these token widths and run the other shapes eager (None: compile every shape)."""
        self.model, self.grid, self.device = model, grid, device
        self.cache = KVCache(model.config, grid.max_batch + 1, grid.max_cache, dtype, device)
        self.shapes: Counter[tuple] = Counter()
        self.recent_seconds: dict[tuple, float] = {}  # per-shape moving average, for choosing K
        self.warm_seconds: dict[tuple, float] = {}  # recent_seconds as the warm-up left them
        self.busy_seconds = 0.0  # inside forwards, all shapes: the rest of a step is host work
        self.warm_shapes_seconds = 0.0  # inside forwards of warmed-up shapes, since warm-up
        self.warm_shapes_expected = 0.0  # the same forwards at their warm-up times
        self.computed_slots: Counter[str] = Counter()  # token slots run, per phase
        self.useful_slots: Counter[str] = Counter()  # of them, real tokens of live rows
        self.compiles = 0
        if not compile_model:  # inductor picks its own kernels
            if exact_rows and device.type == "cpu":
                target_linears_for(
                    model, device, decode_row_counts(grid.batch_sizes, grid.draft_lengths)
                )
                fold_queries_where_exact(model, (1, *(k + 1 for k in grid.draft_lengths)))
            elif dtype == torch.bfloat16:
                bf16_linears_for(model, device)
        self._forward = model.forward
        compiles = compile_model and device.type in ("cpu", "cuda")
        hpu_graphed = hpu_graphs and device.type == "hpu"
        capture = graph_capture(device) if cuda_graphs else None
        # A shape's first call compiles or captures a graph: seconds no later call pays.
        self.first_call_builds = bool(compiles or hpu_graphed or capture)
        # What the metrics' cpu_kernels name (inductor may fuse or repack plain linears).
        self.kernels = ("compiled:" if compiles else "") + kernels.linear_kernels(model)
        if compiles:
            _raise_recompile_limit(grid)
            compiled = torch.compile(model.forward, dynamic=False, backend=self._counting_backend)
            self._forward = (compiled if compiled_widths is None
                             else compiled_for_widths(compiled, model.forward, compiled_widths))
        elif hpu_graphed:
            self._forward = devices.wrap_in_hpu_graph(model).forward
        if capture:  # over the compiled forward too: inductor's kernels are capturable
            self._forward = GraphedForward(self._forward, capture)

    @property
    def graph_captures(self) -> int:
        return self._forward.captures if isinstance(self._forward, GraphedForward) else 0

    def _counting_backend(self, graph_module, example_inputs):
        self.compiles += 1
        return compile_for_this_cpu(graph_module, example_inputs)

    @property
    def forwards(self) -> int:
        return sum(self.shapes.values())

    def _run(self, key: tuple, useful: int, **inputs) -> torch.Tensor:
        started = perf_counter()
        with torch.inference_mode():
            logits = self._forward(cache=self.cache, **inputs)
        devices.mark_step(self.device)
        devices.synchronize(self.device)
        elapsed = perf_counter() - started
        self.busy_seconds += elapsed
        if key in self.warm_seconds:
            self.warm_shapes_seconds += elapsed
            self.warm_shapes_expected += self.warm_seconds[key]
        if self.shapes[key] == 0:
            self.recent_seconds[key] = elapsed
        elif self.shapes[key] < WARM_CALLS:  # the first call pays one-time set-up, and a
            # busy neighbour only adds time: the fastest warm call prices a shape until use
            self.recent_seconds[key] = min(self.recent_seconds[key], elapsed)
        else:  # a moving average, so a reading taken while the host was busy fades out
            self.recent_seconds[key] += 0.25 * (elapsed - self.recent_seconds[key])
        self.shapes[key] += 1
        self.computed_slots[key[0]] += key[1] * key[2]
        self.useful_slots[key[0]] += useful
        return logits

    def load_mark(self) -> tuple[float, float]:
        """Seconds spent in warmed-up shapes so far: measured, and at their warm-up times."""
        return self.warm_shapes_seconds, self.warm_shapes_expected

    def load_since(self, mark: tuple[float, float]) -> float | None:
        """How much slower than in warm-up this runner's forwards ran since `mark` (1.0: as
        fast); None when no warmed-up shape ran."""
        expected = self.warm_shapes_expected - mark[1]
        return (self.warm_shapes_seconds - mark[0]) / expected if expected > 0 else None

    def warm_priced_seconds(
        self, steps: Counter[tuple[int, int]], load: float | None
    ) -> float | None:
        """[b, 1] decode steps by (b, cache bucket) at their warm-up times x `load`; None
        when a shape was never warmed up or no load was measured."""
        keys = {("decode", b, 1, attend): count for (b, attend), count in steps.items()}
        if load is None or any(key not in self.warm_seconds for key in keys):
            return None
        return load * sum(self.warm_seconds[key] * count for key, count in keys.items())

    def recent_seconds_for(self, b: int, t: int) -> float:
        """Recent time of a [b, t] decode forward, averaged over the cache buckets seen."""
        times = [v for key, v in self.recent_seconds.items() if key[:3] == ("decode", b, t)]
        if times:
            return sum(times) / len(times)
        if t > 1:  # unmeasured: assume cost grows linearly with tokens (pessimistic)
            return t * self.recent_seconds_for(b, 1)
        return 1.0

    def recent_prefill_seconds(self, prompts: list[list[int]]) -> float:
        """Recent time of prefilling these prompts: one forward per distinct prompt, as
        `prefill` runs them (a repeated prompt's copies cost next to nothing)."""
        buckets = [bucket(self.grid.prompt_lengths, len(p)) for p in distinct_prompts(prompts)]
        return sum(self.recent_seconds.get(("prefill", 1, t, 0), 0.0) for t in buckets)

    def prefill(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        """Forward each prompt alone into its cache row from position 0, padded to its own
        prompt bucket; logits of each last token [len(prompts), vocab].

        Alone, so no prompt pays for the longest one's bucket, and a prompt's cache and logits
        never depend on what it was admitted with: oneDNN's packed bf16 GEMM rounds a row
        differently with the number of rows in the call (0.008 at 96 vs 384 rows on Qwen
        1.5B), which made a record's tokens depend on its batch. Only this forward's keys are
        attended, so no cache is read and any row may be filled. A prompt repeated in the call
        (samples_per_prompt's samples) runs once and its cache prefix is copied to the other
        rows: the values its own forward would write there.
        """
        logits: list[torch.Tensor | None] = [None] * len(prompts)
        for prompt, (first, *repeats) in distinct_prompts(prompts).items():
            logits[first] = self._prefill_one(list(prompt), rows[first])
            if repeats:
                length = bucket(self.grid.prompt_lengths, len(prompt))
                self.cache.copy_prefix(rows[first], [rows[i] for i in repeats], length)
                for i in repeats:
                    logits[i] = logits[first]
        return torch.cat(logits)

    def _prefill_one(self, prompt: list[int], row: int) -> torch.Tensor:
        t = bucket(self.grid.prompt_lengths, len(prompt))
        tokens = torch.zeros(1, t, dtype=torch.long)
        tokens[0, : len(prompt)] = torch.tensor(prompt)
        positions = torch.arange(t)[None]
        with prefilling():
            logits = self._run(
                ("prefill", 1, t, 0),
                len(prompt),
                tokens=tokens.to(self.device),
                positions=positions.to(self.device),
                rows=torch.tensor([row]).to(self.device),
                mask=self._mask(positions, t).to(self.device),
                logit_index=torch.tensor([[len(prompt) - 1]]).to(self.device),
                attend_len=0,
            )
        return logits[:, 0].clone()  # a graph's output buffer: the next call reuses it

    def decode(
        self,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        useful_rows: int,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward `tokens` [b, t] for cache rows 0..b-1, row i's first token at `starts[i]`.

        Idle rows run at position 0 of their own free cache row. Returns logits [b, n, vocab]
        for the positions in `logit_index` [b, n], by default every position.
        """
        b, t = tokens.shape
        positions = starts[:, None] + torch.arange(t)
        attend = bucket(self.grid.cache_lengths, int(positions.max()) + 1)
        if logit_index is None:
            logit_index = torch.arange(t).expand(b, t)
        return self._run(
            ("decode", b, t, attend),
            useful_rows * t,
            tokens=tokens.to(self.device),
            positions=positions.to(self.device),
            rows=torch.arange(b).to(self.device),
            mask=self._mask(positions, attend).to(self.device),
            logit_index=logit_index.contiguous().to(self.device),
            attend_len=attend,
        )

    def _mask(self, positions: torch.Tensor, keys: int) -> torch.Tensor:
        """[b, 1, t, keys]: a query sees keys at positions <= its own (the model applies its
        layers' sliding windows)."""
        visible = torch.arange(keys)[None, None, :] <= positions[:, :, None]
        return visible[:, None]
