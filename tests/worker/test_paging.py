"""Paged KV cache bookkeeping: allocation, prefix sharing, eviction, and a stateful model check."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from adaptermesh.worker import paging
from adaptermesh.worker.paging import (
    NULL_BLOCK,
    BlockManager,
    NoFreeBlocks,
    blocks_for_budget,
    kv_bytes_per_token,
)

BS = 4


def snapshot(bm: BlockManager) -> Any:
    """Everything observable plus the private pools, to check that a failed call changed nothing."""
    return (
        list(bm._ref),
        list(bm._free),
        list(bm._evictable),
        {h: (r.block, r.serial) for h, r in bm._by_hash.items()},
        {sid: (list(s.table), s.reserved, s.committed_blocks) for sid, s in bm._seqs.items()},
        (bm.stats.query_tokens, bm.stats.hit_tokens, bm.stats.evictions),
    )


def run(bm: BlockManager, seq_id: int, key: object, tokens: list[int]) -> int:
    """Allocate, then pretend the engine computed every token: the common prefill path."""
    cached = bm.allocate(seq_id, key, tokens)
    bm.commit(seq_id, tokens)
    return cached


def check_invariants(bm: BlockManager) -> None:
    refs: dict[int, int] = {}
    for s in bm._seqs.values():
        assert len(set(s.table)) == len(s.table)
        assert len(s.table) == -(-s.reserved // bm.block_size)
        for b in s.table:
            refs[b] = refs.get(b, 0) + 1
    for b in range(bm.num_blocks):
        assert bm._ref[b] == refs.get(b, 0), b
    free, evictable, referenced = set(bm._free), set(bm._evictable), set(refs)
    assert len(free) == len(bm._free)
    assert NULL_BLOCK not in free | evictable | referenced
    assert not free & referenced
    assert not evictable & referenced
    assert not free & evictable
    assert len(free) + len(evictable) + len(referenced) == bm.num_blocks - 1
    assert bm.num_free() == len(free) + len(evictable)
    assert bm.usage() == pytest.approx(len(referenced) / (bm.num_blocks - 1))
    for h, reg in bm._by_hash.items():
        assert reg.hash == h
        assert bm._reg_of[reg.block] is reg
        assert len(reg.tokens) == bm.block_size
    registered = {r.block for r in bm._by_hash.values()}
    assert {b for b in range(bm.num_blocks) if bm._reg_of[b] is not None} == registered
    assert evictable <= registered
    assert bm.num_cached_blocks() == len(registered)


# ---- sizing -------------------------------------------------------------------------------------


def test_budget_helpers() -> None:
    per_tok = kv_bytes_per_token(num_layers=2, num_kv_heads=4, head_dim=8, dtype_bytes=2)
    assert per_tok == 2 * 2 * 4 * 8 * 2
    per_block = per_tok * 16
    assert blocks_for_budget(10 * per_block + per_block - 1, 2, 4, 8, 16, 2) == 10
    assert blocks_for_budget(0, 2, 4, 8, 16, 2) == 0
    with pytest.raises(ValueError):
        kv_bytes_per_token(0, 4, 8, 2)
    with pytest.raises(ValueError):
        BlockManager(1, BS)


# ---- allocation and release ---------------------------------------------------------------------


def test_allocate_free_round_trip() -> None:
    bm = BlockManager(9, BS)
    assert bm.num_free() == 8
    assert bm.usage() == 0.0
    assert bm.allocate(1, "a", list(range(10))) == 0
    assert bm.block_table(1) == [1, 2, 3]
    assert bm.num_free() == 5
    assert bm.usage() == pytest.approx(3 / 8)
    assert bm.slot(1, 5) == 2 * BS + 1
    assert bm.slots(1, 2, 7) == [6, 7, 8, 9, 10, 11, 12]
    assert bm.slots(1, 9, 1) == [13]
    assert bm.slots(1, 3, 0) == []
    with pytest.raises(IndexError):
        bm.slot(1, 10)
    with pytest.raises(IndexError):
        bm.slots(1, 8, 3)
    assert bm.block_tables([1], 5) == [[1, 2, 3, NULL_BLOCK, NULL_BLOCK]]
    check_invariants(bm)
    bm.free(1)
    assert bm.num_free() == 8
    assert bm.usage() == 0.0
    check_invariants(bm)
    with pytest.raises(KeyError):
        bm.free(1)
    with pytest.raises(ValueError):
        bm.allocate(2, "a", [])


def test_blocks_are_reused_after_free() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    bm.allocate(1, "a", list(range(12)))
    assert not bm.can_allocate(1, "a", [0])
    bm.free(1)
    bm.allocate(2, "a", list(range(100, 112)))
    assert sorted(bm.block_table(2)) == [1, 2, 3]
    check_invariants(bm)


def test_append_slots_grows_by_block() -> None:
    bm = BlockManager(4, BS)
    bm.allocate(1, "a", [1, 2, 3])
    assert bm.append_slots(1, 1)
    assert len(bm.block_table(1)) == 1
    assert bm.append_slots(1, 1)
    assert len(bm.block_table(1)) == 2
    assert bm.num_reserved(1) == 5
    assert bm.slots(1, 3, 2) == [bm.block_table(1)[0] * BS + 3, bm.block_table(1)[1] * BS]
    check_invariants(bm)


def test_append_slots_false_leaves_state_unchanged() -> None:
    bm = BlockManager(4, BS)
    run(bm, 1, "a", list(range(8)))
    bm.allocate(2, "b", [9])
    before = snapshot(bm)
    assert bm.num_free() == 0
    assert not bm.append_slots(2, 8)  # needs 2 more blocks
    assert snapshot(bm) == before
    assert bm.append_slots(2, 3)  # still fits in its own block
    check_invariants(bm)


def test_no_free_blocks_leaves_state_unchanged() -> None:
    bm = BlockManager(5, BS)
    run(bm, 1, "a", list(range(8)))
    bm.free(1)  # two evictable cached blocks
    bm.allocate(2, "b", list(range(50, 58)))  # takes the two free blocks
    before = snapshot(bm)
    assert not bm.can_allocate(9, "c", list(range(9)))
    with pytest.raises(NoFreeBlocks):
        bm.allocate(3, "c", list(range(9)))  # needs 3, only 2 evictable
    assert snapshot(bm) == before
    check_invariants(bm)


def test_can_allocate_counts_prefix_hits() -> None:
    bm = BlockManager(5, BS)
    prompt = list(range(12))
    run(bm, 1, "a", prompt)
    # 1 free block: a miss needs 3, a hit on the first two blocks needs 1.
    assert bm.num_free() == 1
    assert bm.can_allocate(12, "a", prompt)
    assert not bm.can_allocate(12, "b", prompt)
    assert not bm.can_allocate(13, "a", prompt)  # headroom: 2 hits + 2 fresh
    assert bm.can_allocate(13, "a", [*prompt, 99])  # 3 hits + 1 fresh
    with pytest.raises(ValueError):
        bm.can_allocate(3, "a", prompt)


# ---- prefix sharing -----------------------------------------------------------------------------


def test_prefix_shared_for_same_key_and_tokens() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(10))  # two full blocks + 2 tokens
    assert run(bm, 1, "a", prompt) == 0
    assert bm.num_cached_blocks() == 2
    cached = bm.allocate(2, "a", [*prompt[:8], 77, 78, 79])
    assert cached == 8
    t1, t2 = bm.block_table(1), bm.block_table(2)
    assert t1[:2] == t2[:2]
    assert t1[2] != t2[2]
    assert bm._ref[t1[0]] == 2
    assert bm._ref[t1[2]] == 1
    assert (bm.stats.query_tokens, bm.stats.hit_tokens) == (21, 8)
    check_invariants(bm)
    # The shared blocks survive the first owner and stay shared by the second.
    bm.free(1)
    assert bm._ref[t1[0]] == 1
    check_invariants(bm)


def test_prefix_shared_after_owner_freed() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(9))
    run(bm, 1, "a", prompt)
    table = bm.block_table(1)
    bm.free(1)
    assert bm.num_free() == 15
    assert bm.num_cached_blocks() == 2
    assert bm.allocate(2, "a", prompt) == 8
    assert bm.block_table(2)[:2] == table[:2]
    check_invariants(bm)


def test_never_shared_across_keys() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(12))
    run(bm, 1, "adapter-a", prompt)
    assert bm.allocate(2, "adapter-b", prompt) == 0
    assert not set(bm.block_table(1)) & set(bm.block_table(2))
    assert bm.allocate(3, None, prompt) == 0  # the base model is a key of its own
    check_invariants(bm)


def test_partial_blocks_never_shared() -> None:
    bm = BlockManager(16, BS)
    run(bm, 1, "a", [1, 2, 3])  # less than one block: nothing to register
    assert bm.num_cached_blocks() == 0
    assert bm.allocate(2, "a", [1, 2, 3, 4, 5]) == 0
    assert not set(bm.block_table(1)) & set(bm.block_table(2))
    check_invariants(bm)


def test_divergence_inside_a_block_stops_the_hit() -> None:
    bm = BlockManager(16, BS)
    run(bm, 1, "a", list(range(13)))
    other = [*range(5), 99, *range(6, 13)]  # differs in block 1
    assert bm.allocate(2, "a", other) == 4
    check_invariants(bm)


def test_fully_cached_prompt_still_computes_one_token() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(3 * BS))
    run(bm, 1, "a", prompt)
    assert bm.num_cached_blocks() == 3
    cached = bm.allocate(2, "a", prompt)
    assert cached == 2 * BS  # the last block is recomputed, so its last token yields logits
    t1, t2 = bm.block_table(1), bm.block_table(2)
    assert t2[:2] == t1[:2]
    assert t2[2] != t1[2]
    # Recomputing the last block finds it already registered: the copy stays private.
    bm.commit(2, prompt)
    assert bm.num_cached_blocks() == 3
    check_invariants(bm)
    bm.free(2)
    assert t2[2] in bm._free  # unregistered copy goes straight back
    # A one-token prompt can never hit.
    run(bm, 3, "a", [5])
    assert bm.allocate(4, "a", [5]) == 0


def test_resumed_sequence_hits_its_own_output() -> None:
    bm = BlockManager(16, BS)
    prompt = [7, 7, 7]
    bm.allocate(1, "a", prompt)
    known = list(prompt)
    bm.commit(1, known)
    for tok in range(10):  # decode: reserve, write, commit
        assert bm.append_slots(1, 1)
        known.append(tok)
        bm.commit(1, known)
    assert bm.num_cached_blocks() == 3
    bm.free(1)  # preempted
    assert bm.allocate(1, "a", known) == 12
    check_invariants(bm)


def test_commit_is_idempotent_and_bounded() -> None:
    bm = BlockManager(16, BS)
    toks = list(range(8))
    bm.allocate(1, "a", toks)
    bm.commit(1, toks[:3])
    assert bm.num_cached_blocks() == 0
    bm.commit(1, toks)
    before = snapshot(bm)
    bm.commit(1, toks)
    bm.commit(1, toks[:5])
    assert snapshot(bm) == before
    with pytest.raises(ValueError):
        bm.commit(1, [*toks, 9])


def test_concurrent_duplicates_keep_chain_reachable() -> None:
    """Two sequences compute the same prompt at once: the second copy stays private, and the
    block after it is still found through the first copy."""
    bm = BlockManager(32, BS)
    prompt = list(range(8))
    bm.allocate(1, "a", prompt)
    bm.allocate(2, "a", [*prompt, 8, 9, 10, 11, 12])
    bm.commit(1, prompt)
    bm.commit(2, [*prompt, 8, 9, 10, 11])
    assert bm.num_cached_blocks() == 3
    assert bm.allocate(3, "a", [*prompt, 8, 9, 10, 11, 12]) == 12
    t1, t2, t3 = bm.block_table(1), bm.block_table(2), bm.block_table(3)
    assert t3[:2] == t1[:2]
    assert t3[2] == t2[2]
    check_invariants(bm)


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    prompt = list(range(12))
    run(bm, 1, "a", prompt)
    assert bm.num_cached_blocks() == 0
    bm.free(1)
    assert bm.allocate(2, "a", prompt) == 0
    check_invariants(bm)


# ---- eviction and reset -------------------------------------------------------------------------


def test_eviction_is_lru_among_refcount_zero_blocks() -> None:
    bm = BlockManager(8, BS)
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    for sid, toks in ((1, a), (2, b), (3, c)):
        run(bm, sid, "k", [*toks, 0])  # one full cached block + one private block each
    ba, bb, bc = (bm.block_table(s)[0] for s in (1, 2, 3))
    bm.free(2)
    bm.free(1)
    bm.free(3)
    assert list(bm._evictable) == [bb, ba, bc]  # in release order
    # Reusing b's block refreshes it: on release it becomes the most recently used.
    assert bm.allocate(4, "k", [*b, 0]) == 4
    bm.free(4)
    assert list(bm._evictable) == [ba, bc, bb]
    # Four blocks are free; a fifth fresh block evicts the least recently used: a's.
    bm.allocate(5, "other", list(range(5 * BS)))
    assert bm.stats.evictions == 1
    assert ba in bm.block_table(5)
    assert list(bm._evictable) == [bc, bb]
    bm.free(5)
    assert bm.allocate(6, "k", [*a, 0]) == 0
    assert bm.allocate(7, "k", [*c, 0]) == 4
    assert bm.allocate(8, "k", [*b, 0]) == 4
    check_invariants(bm)


def test_release_evicts_tail_before_head() -> None:
    bm = BlockManager(8, BS)
    toks = list(range(3 * BS + 1))
    run(bm, 1, "k", toks)
    t = bm.block_table(1)
    bm.free(1)
    assert list(bm._evictable) == [t[2], t[1], t[0]]


def test_reset_prefix_cache() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(9))
    run(bm, 1, "a", prompt)
    run(bm, 2, "b", prompt)
    bm.free(1)
    assert bm.num_cached_blocks() == 4
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks() == 0
    assert bm.num_free() == 12
    check_invariants(bm)
    # Neither released nor in-use KV from before the reset can be hit any more ...
    assert bm.allocate(3, "a", prompt) == 0
    assert bm.allocate(4, "b", prompt) == 0
    # ... and a sequence from before the reset registers nothing new.
    assert bm.append_slots(2, 4)
    bm.commit(2, [*prompt, 1, 2, 3, 4])
    assert bm.num_cached_blocks() == 0
    bm_table = bm.block_table(2)
    bm.free(2)
    assert all(b in bm._free for b in bm_table)  # its blocks went straight back
    check_invariants(bm)


def test_hash_collisions_are_harmless(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paging, "_chain_hash", lambda parent, key, tokens: 0)
    bm = BlockManager(32, BS)
    x = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run(bm, 1, "a", x)
    assert bm.num_cached_blocks() == 1  # block 1 collides with block 0 and stays private
    assert bm.allocate(2, "a", [9, 9, 9, 9, 9]) == 0  # different tokens
    assert bm.allocate(3, "b", x) == 0  # different key
    assert bm.allocate(4, "a", [5, 6, 7, 8, 1, 2, 3, 4, 0]) == 0
    assert bm.allocate(5, "a", x) == 4  # the one true hit
    check_invariants(bm)


def test_chains_cannot_be_spliced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even when the hash ignores the parent, a block is found only under its own parent."""
    monkeypatch.setattr(paging, "_chain_hash", lambda parent, key, tokens: hash((key, tokens)))
    bm = BlockManager(32, BS)
    a, x, b = [1] * 4, [2] * 4, [3] * 4
    run(bm, 1, "k", [*a, 0])
    run(bm, 2, "k", [*x, *b, 0])  # registers b's block as the child of x
    assert bm.allocate(3, "k", [*a, *b, 0]) == 4  # a hits, b under a does not
    assert bm.allocate(4, "k", [*x, *b, 0]) == 8
    check_invariants(bm)


_A, _B, _C = (1, 2, 3, 4), (5, 6, 7, 8), (9, 9, 9, 9)


@pytest.mark.parametrize(
    ("weak_hash", "second"),
    [
        # The hash ignores the parent: the second sequence's copy of A sits behind another A.
        (lambda parent, key, tokens: hash((key, tokens)), ("k", [*_A, *_A, *_B, 0])),
        # The hash ignores the key: the second sequence is another adapter.
        (lambda parent, key, tokens: hash((parent, tokens)), ("j", [*_A, *_B, 0])),
        # A and C collide outright.
        (
            lambda parent, key, tokens: 0 if tokens in (_A, _C) else hash((parent, key, tokens)),
            ("k", [*_C, *_B, 0]),
        ),
    ],
    ids=["parent-blind", "key-blind", "token-collision"],
)
def test_commit_treats_only_true_duplicates_as_duplicates(
    monkeypatch: pytest.MonkeyPatch, weak_hash: Any, second: tuple[str, list[int]]
) -> None:
    """A block that only collides with a registered one must not borrow its identity, or the
    block registered after it would be found behind the wrong prefix."""
    monkeypatch.setattr(paging, "_chain_hash", weak_hash)
    bm = BlockManager(32, BS)
    run(bm, 1, "k", [*_A, 0])
    run(bm, 2, *second)  # registers B behind something that is not ("k", A)
    assert bm.allocate(3, "k", [*_A, *_B, 0]) == 4
    check_invariants(bm)


# ---- stateful model check -----------------------------------------------------------------------

KEYS = ("a", "b", None)
# A few base streams with repeated structure, so prompts share whole blocks often. With the
# machine's block size of 3 the last one repeats the same block under ever longer prefixes.
BASES = (
    [1, 2, 3, 4] * 4 + [5, 6, 7, 8] * 2,
    [1, 2, 3, 4] * 2 + [9, 9, 9, 9] * 4,
    [5, 6, 7, 8] * 6,
    [1, 2, 3] * 8,
)


class PagingMachine(RuleBasedStateMachine):
    """Drive a BlockManager as an engine would and keep a shadow of what every block holds.

    The shadow records, per physical block and offset, the (key, token prefix) whose KV the
    simulated engine wrote there. A prefix hit is correct exactly when every slot of every hit
    block holds the KV of the new sequence's own (key, prefix) at that position.
    """

    num_blocks = 12
    block_size = 3

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.num_blocks, self.block_size)
        self.live: dict[int, dict[str, Any]] = {}  # id -> key, toks, computed, epoch
        self.written: dict[tuple[int, int], tuple[object, tuple[int, ...]]] = {}
        self.next_id = 0
        self.epoch = 0

    @initialize()
    def start(self) -> None:
        check_invariants(self.bm)

    def _forget(self, blocks: list[int]) -> None:
        """Fresh blocks hold nothing the shadow may vouch for."""
        for b in blocks:
            for off in range(self.block_size):
                self.written.pop((b, off), None)

    def _write(self, sid: int, upto: int) -> None:
        """The engine computes positions [computed, upto) of ``sid``: never into a shared block."""
        m = self.live[sid]
        bs = self.block_size
        table = self.bm.block_table(sid)
        for p in range(m["computed"], upto):
            b = table[p // bs]
            assert self.bm._ref[b] == 1, f"write into shared block {b}"
            self.written[(b, p % bs)] = (m["key"], tuple(m["toks"][: p + 1]))
        m["computed"] = upto

    @rule(
        target=seqs,
        key=st.sampled_from(KEYS),
        base=st.sampled_from(BASES),
        n=st.integers(1, 20),
        tail=st.lists(st.integers(0, 3), max_size=3),
    )
    def allocate(self, key: object, base: list[int], n: int, tail: list[int]) -> Any:
        toks = base[:n] + tail
        sid = self.next_id
        self.next_id += 1
        fits = self.bm.can_allocate(len(toks), key, toks)
        before = snapshot(self.bm)
        try:
            cached = self.bm.allocate(sid, key, toks)
        except NoFreeBlocks:
            assert not fits
            assert snapshot(self.bm) == before
            return multiple()
        assert fits
        bs = self.block_size
        assert cached % bs == 0
        assert 0 <= cached < len(toks)
        table = self.bm.block_table(sid)
        for p in range(cached):
            assert self.written.get((table[p // bs], p % bs)) == (key, tuple(toks[: p + 1])), (
                "wrong hit"
            )
        self._forget(table[cached // bs :])
        self.live[sid] = {"key": key, "toks": list(toks), "computed": cached, "epoch": self.epoch}
        return sid

    @rule(sid=seqs, n=st.integers(0, 5))
    def append(self, sid: Any, n: int) -> None:
        if sid not in self.live:
            return
        before = snapshot(self.bm)
        old = self.bm.block_table(sid)
        if not self.bm.append_slots(sid, n):
            assert snapshot(self.bm) == before
            assert self.bm.num_free() < n
            return
        table = self.bm.block_table(sid)
        assert table[: len(old)] == old
        self._forget(table[len(old) :])
        assert self.bm.num_reserved(sid) >= len(self.live[sid]["toks"])

    @rule(
        sid=seqs,
        k=st.integers(1, 8),
        sampled=st.lists(st.integers(0, 3), min_size=8, max_size=8),
        twice=st.booleans(),
    )
    def compute(self, sid: Any, k: int, sampled: list[int], twice: bool) -> None:
        if sid not in self.live:
            return
        m = self.live[sid]
        upto = min(m["computed"] + k, self.bm.num_reserved(sid))
        # Sampled tokens become known before their KV is written.
        m["toks"].extend(sampled[: max(0, upto - len(m["toks"]))])
        self._write(sid, upto)
        self.bm.commit(sid, m["toks"][:upto])
        if twice:
            before = snapshot(self.bm)
            self.bm.commit(sid, m["toks"][:upto])
            assert snapshot(self.bm) == before

    @rule(sid=consumes(seqs))
    def free(self, sid: Any) -> None:
        if sid not in self.live:
            return
        self.bm.free(sid)
        del self.live[sid]

    @rule()
    def reset(self) -> None:
        self.bm.reset_prefix_cache()
        self.epoch += 1
        assert self.bm.num_cached_blocks() == 0

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        check_invariants(bm)
        bs = bm.block_size
        owners: dict[int, list[tuple[int, int]]] = {}
        for sid, m in self.live.items():
            table = bm.block_table(sid)
            assert len(table) == -(-bm.num_reserved(sid) // bs)
            assert bm.num_reserved(sid) >= m["computed"]
            for i, b in enumerate(table):
                owners.setdefault(b, []).append((sid, i))
        for b, refs in owners.items():
            if len(refs) < 2:
                continue
            # Shared blocks are full and their KV is final for every sharer, so nobody writes them.
            for sid, i in refs:
                assert (i + 1) * bs <= self.live[sid]["computed"]
            # They are registered, unless every sharer predates the last reset (which unregisters).
            if any(self.live[sid]["epoch"] == self.epoch for sid, _ in refs):
                assert bm._reg_of[b] is not None


class _PatchedHashMachine(PagingMachine):
    """The model check under a deliberately weak chain hash: verification alone must keep
    every hit correct."""

    @staticmethod
    def weak_hash(parent: int, key: object, tokens: tuple[int, ...]) -> int:
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self._saved = paging._chain_hash
        paging._chain_hash = self.weak_hash

    def teardown(self) -> None:
        paging._chain_hash = self._saved


class KeyBlindHashMachine(_PatchedHashMachine):
    """Equal blocks under other keys or behind other prefixes hash alike (chains stay deep)."""

    @staticmethod
    def weak_hash(parent: int, key: object, tokens: tuple[int, ...]) -> int:
        return hash(tokens)


class FourBucketHashMachine(_PatchedHashMachine):
    """Different blocks collide all the time."""

    @staticmethod
    def weak_hash(parent: int, key: object, tokens: tuple[int, ...]) -> int:
        return hash((parent, key, tokens)) % 4


_SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestPagingModel = PagingMachine.TestCase
TestPagingModel.settings = _SETTINGS
TestPagingModelKeyBlindHash = KeyBlindHashMachine.TestCase
TestPagingModelKeyBlindHash.settings = _SETTINGS
TestPagingModelFourBucketHash = FourBucketHashMachine.TestCase
TestPagingModelFourBucketHash.settings = _SETTINGS
