"""Which records duplicate another: each normalised completion is hashed to keys that its
duplicates share, records sharing a key are linked, and each cluster of linked records keeps
its first record in canonical order (earlier runs' kept records first, then (id, sample_index)).

exact: one key, a 128-bit hash of the normalised text. minhash: datasketch's MinHash of the
text's 3-word shingles, cut into the bands datasketch's MinHashLSH chooses for the threshold;
a band's key is its number and a 64-bit hash of its values (MinHashLSH keys its hash tables by
those values). Clusters are transitive (connected components), as MinHash deduplication at scale
does: no pairwise similarity is computed. Keys are pure functions of the text, so the same
records give the same clusters whatever order they arrive in.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import unicodedata
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache, partial
from multiprocessing import get_context

import numpy as np
from datasketch import MinHash, MinHashLSH
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

NUM_PERM = 128
SHINGLE_WORDS = 3
# Part of the index's name: bump it when normalisation or keys change, so an output's old index
# (whose keys would no longer match) is not mixed with new keys.
KEYS_VERSION = 1
CHUNK = 20_000  # texts per worker task; fewer than two chunks are hashed in this process
MAX_WORKERS = 8
_PUNCTUATION = re.compile(r"[^\w\s]+")
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def normalise(text: str) -> str:
    """NFKC, case-folded, punctuation dropped, whitespace collapsed: completions that differ only
    in case, quotes, punctuation or spacing are the same text."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(_PUNCTUATION.sub(" ", folded).split())


def shingles(normalised: str) -> list[bytes]:
    """The text's 3-word shingles; a shorter text is one shingle, an empty one has none."""
    words = normalised.split()
    if len(words) <= SHINGLE_WORDS:
        return [normalised.encode()] if words else []
    return [" ".join(words[i : i + SHINGLE_WORDS]).encode()
            for i in range(len(words) - SHINGLE_WORDS + 1)]


def rule_key(method: str, threshold: float) -> str:
    """Names an index: only records keyed alike can match (minhash bands depend on threshold)."""
    return f"exact-v{KEYS_VERSION}" if method == "exact" else (
        f"minhash-{threshold:g}-v{KEYS_VERSION}")


@lru_cache
def lsh_bands(threshold: float) -> tuple[int, int]:
    """(bands, rows per band): datasketch's choice for the threshold, weighing false positives
    and false negatives alike."""
    lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM)
    return lsh.b, lsh.r


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 that spreads every input bit."""
    values = (values ^ (values >> np.uint64(30))) * _MIX[0]
    values = (values ^ (values >> np.uint64(27))) * _MIX[1]
    return values ^ (values >> np.uint64(31))


def _band_hashes(band: np.ndarray) -> np.ndarray:
    """(n, rows) uint32 -> (n,) uint64, folded column by column: two different bands share a
    hash with odds near 2^-64."""
    folded = np.zeros(len(band), np.uint64)
    for column in band.T.astype(np.uint64):
        folded = _mix(folded ^ column)
    return folded


def text_keys(texts: list[str], method: str, threshold: float) -> np.ndarray:
    """(n, keys, 2) uint64: each text's keys as (high, low) words; duplicates share a key."""
    normalised = [normalise(text) for text in texts]
    if method == "exact":
        digests = b"".join(hashlib.blake2b(text.encode(), digest_size=16).digest()
                           for text in normalised)
        return np.frombuffer(digests, "<u8").reshape(len(texts), 1, 2).copy()
    bands, rows = lsh_bands(threshold)
    signatures = np.empty((len(texts), bands * rows), np.uint32)
    minhashes = MinHash.generator(map(shingles, normalised), num_perm=NUM_PERM, seed=1,
                                  scheme="affine32")  # explicit: an output's index relies on them
    for i, minhash in enumerate(minhashes):
        signatures[i] = minhash.hashvalues[: bands * rows]
    keys = np.empty((len(texts), bands, 2), np.uint64)
    keys[:, :, 0] = np.arange(bands, dtype=np.uint64)
    for band in range(bands):
        keys[:, band, 1] = _band_hashes(signatures[:, band * rows : (band + 1) * rows])
    return keys


def worker_count() -> int:
    return min(len(os.sched_getaffinity(0)), MAX_WORKERS)


def _ignore_interrupts() -> None:
    """Ctrl-C reaches the whole process group: the parent decides what stops, not a worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def keys_of(texts: list[str], method: str, threshold: float, workers: int) -> np.ndarray:
    """text_keys over chunks in `workers` processes (spawned: the caller may hold threads and
    an engine that must not be forked). The result does not depend on `workers`."""
    hashing = partial(text_keys, method=method, threshold=threshold)
    if workers <= 1 or len(texts) < 2 * CHUNK:
        return hashing(texts)
    chunks = [texts[i : i + CHUNK] for i in range(0, len(texts), CHUNK)]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"),
                             initializer=_ignore_interrupts) as pool:
        return np.concatenate(list(pool.map(hashing, chunks)))


def first_of_cluster(
    keys: np.ndarray, earlier_keys: np.ndarray, earlier_nodes: np.ndarray, earlier_count: int
) -> np.ndarray:
    """For each new record (`keys`, in canonical order), the first member of its cluster: a node
    below `earlier_count` is an earlier run's kept record (`earlier_keys[i]` belongs to node
    `earlier_nodes[i]`, nodes in canonical order), node `earlier_count + j` is new record j. A new
    record is kept when it is its cluster's first member."""
    count, per_record = keys.shape[:2]
    total = earlier_count + count
    nodes = np.concatenate([earlier_nodes.astype(np.int64),
                            earlier_count + np.repeat(np.arange(count), per_record)])
    flat = np.concatenate([earlier_keys.reshape(-1, 2), keys.reshape(-1, 2)])
    order = np.lexsort((nodes, flat[:, 1], flat[:, 0]))
    flat, nodes = flat[order], nodes[order]
    same = (flat[1:] == flat[:-1]).all(axis=1)
    links = coo_matrix((np.ones(int(same.sum()), np.int8), (nodes[:-1][same], nodes[1:][same])),
                       shape=(total, total))
    _, labels = connected_components(links, directed=False)
    _, first = np.unique(labels, return_index=True)  # labels are 0..n-1: each one's first node
    return first[labels[earlier_count:]]
