"""Prompt sets and shape grids shared by the benchmarks and the tests, so both measure and
check the same workloads."""

from __future__ import annotations

from schemas import BucketGrid, ModelSpec

SMOLLM2 = ModelSpec(path="packaged:smollm2-135m-instruct")

STORY_TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint",
    "two friends lost in a night market",
    "a dragon who is afraid of heights",
    "a detective cat solving a mystery in a library",
    "the last tree on a space station",
    "a baker who can taste memories",
    "a girl who befriends a thunderstorm",
]
FREE_TEXT = [[{"role": "user", "content": f"Write a short story about {t}."}] for t in STORY_TOPICS]

PARAGRAPHS = [
    "The city council met on Tuesday evening to discuss the new public library. Residents asked "
    "for longer opening hours, more study rooms and a larger children's section. The council "
    "agreed to publish a revised plan before the end of the month.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon "
    "dioxide and water. It takes place mainly in the leaves, inside small structures called "
    "chloroplasts, and it releases oxygen into the air as a by-product.",
    "Our team shipped the new release on Friday. It fixes the login timeout, speeds up the search "
    "page by a third and adds an export button to every report. Please update before Monday so "
    "that the old servers can be switched off.",
    "The river rises every spring when the snow melts in the mountains. Farmers along its banks "
    "plant late, after the water has gone down, and the rich soil it leaves behind gives them "
    "some of the best harvests in the region.",
]
COPY_HEAVY = [
    [{"role": "user", "content": f"Rewrite the following paragraph, keeping its wording:\n\n{p}"}]
    for p in PARAGRAPHS * 2
]
PROMPT_SETS = {"free_text": FREE_TEXT, "copy": COPY_HEAVY}

# The speculation-payoff workload: four copy-heavy prompts at batch 4 (bench/payoff.py and
# tests/test_reporting.py's plain-step replay).
COPY_PROMPTS = COPY_HEAVY[: len(PARAGRAPHS)]
PAYOFF_GRID = BucketGrid(
    batch_sizes=[1, 2, 4], prompt_lengths=[128], cache_lengths=[256], draft_lengths=[4]
)
