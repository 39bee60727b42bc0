"""Concurrent sequences drafting with the model's MTP head (patch ``batch-speculative-decoding``,
``mechanisms/mtp/batched.py``).

``BatchGenerator(model, draft_model=model.make_draft_model(), ...)`` - what ``mlx_lm.server
--draft-model mtp`` builds - drafts for every row with the head in one batched pass, verifies all
rows in one pass of the main model, and each row accepts its own number of tokens. Checkpoints
with a head are written to disk and loaded (float32). The random head rarely agrees with the
model, so most tests hint it (``support/batch_hints.py``): the real head runs, and at two of
every three positions the true token gets a bonus before its pick. Every row must equal greedy
decoding of that prompt alone (tokens, log-probabilities within 1e-4), in fewer steps than
tokens; the head's own logits must be those of a single-sequence head pass over the row's
positions; heads whose caches cannot be batched leave the generator decoding plainly.
"""

import importlib.util
import json
import re
import sys

import pytest

from mlx_lm_patches.mechanisms.adaptive import forced
from mlx_lm_patches.patches.batch_speculative_decoding import ATTR
from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint
from mlx_lm_patches.selftest.scenarios import Decoded, greedy, prompt_tokens
from support.batch_hints import hint_proposals

import mlx.core as mx  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(sys.modules["mlx_lm.generate"], "GenerationBatch"),
                                reason="this mlx-lm's BatchGenerator (before 0.31.2) does not host speculation")


def _present(*families):
    return [f for f in families if importlib.util.find_spec(f"mlx_lm.models.{f}") is not None]


HYBRID = _present("qwen3_5", "qwen3_next")[0]
# hybrids with a head, and a dense control (the DeepSeek-V3 layout)
FAMILIES = _present(HYBRID, "nemotron_h", "deepseek_v3")
PROMPTS = [prompt_tokens(n, seed=n) for n in (5, 9, 13, 30)]
SCHEDULE = [3, 1, 0, 0, 2, 3, 0, 3, 3, 1, 0, 2]  # up and down, runs without drafts and back
TOKENS = 14


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from mlx_lm import load

    root = tmp_path_factory.mktemp("batch-mtp")
    cache = {}

    def get(family):
        if family not in cache:
            written = write_mtp_checkpoint(root, family.split(":")[0], dtype="float32", name=family.replace(":", "-"))
            if family.endswith(":sliding"):  # its MTP layer slides over a window shorter than the rows
                config = json.loads((written.folder / "config.json").read_text())
                config.update(mtp_layer_types=["sliding_attention"], sliding_window=4)
                (written.folder / "config.json").write_text(json.dumps(config))
            cache[family] = load(str(written.folder))[0]
            if family.endswith(":sliding"):
                assert cache[family].mtp.layers[0].is_sliding_window, cache[family].mtp_status
        return cache[family]

    return get


def _generator(model, schedule=SCHEDULE, k=3, **options):
    from mlx_lm.generate import BatchGenerator

    with forced(schedule):
        return BatchGenerator(model, max_tokens=TOKENS, draft_model=model.make_draft_model(),
                              num_draft_tokens=k, **options)


def _decode(gen, model, prompts, max_tokens, late=None, late_after=2, hinted=True):
    """Drive ``gen`` over ``prompts`` (``late``: more prompts inserted after ``late_after`` steps),
    hinting its head towards each row's greedy reference. Returns ``([Decoded], steps)``,
    ``steps`` summing, per step, the rows that emitted tokens."""
    references = {}

    def insert(batch):
        uids = gen.insert([list(p) for p in batch], [max_tokens] * len(batch))
        for uid, prompt in zip(uids, batch):
            references[uid] = list(prompt) + greedy(model, prompt, max_tokens=max_tokens).tokens
        return uids

    uids = insert(prompts)
    if hinted:
        hint_proposals(gen, references)
    decoded = {uid: Decoded([], []) for uid in uids}
    left, steps, calls = set(uids), 0, 0
    while left:
        responses = gen.next_generated()
        calls += 1
        steps += len({r.uid for r in responses})
        for r in responses:
            decoded[r.uid].tokens.append(int(r.token))
            decoded[r.uid].logprobs.append(r.logprobs)
            if r.finish_reason is not None:
                left.discard(r.uid)
        if late and calls == late_after:
            new = insert(late)
            uids += new
            decoded.update({uid: Decoded([], []) for uid in new})
            left.update(new)
    mx.eval([d.logprobs for d in decoded.values()])
    return [decoded[uid] for uid in uids], steps


def _assert_rows_equal_greedy(model, prompts, got, max_tokens):
    for i, (prompt, decoded) in enumerate(zip(prompts, got)):
        problem = greedy(model, prompt, max_tokens=max_tokens).compare(decoded)
        assert problem is None, f"row {i} ({len(prompt)} tokens): {problem}"


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_drafting_with_the_head_each_equal_greedy_alone(loaded, family):
    """Rows of different lengths, two joining while the first decode, draft lengths up and down
    and rounds without drafts: every row equals greedy decoding alone, in fewer steps than
    tokens; when the last row has left, the head's caches and waiting states hold no row."""
    model = loaded(family)
    gen = _generator(model)
    got, steps = _decode(gen, model, PROMPTS[:2], TOKENS, late=PROMPTS[2:])
    spec = vars(gen._generation_batch)[ATTR]
    gen.close()
    _assert_rows_equal_greedy(model, PROMPTS, got, TOKENS)
    assert steps < TOKENS * len(PROMPTS), f"{steps} row-steps for {TOKENS} tokens a row: no draft was accepted"
    assert type(spec.drafts).__name__ == "HeadDrafts"
    assert spec.drafts.cache == [] and spec.drafts.rows == [] and spec.pending == []


def test_an_unhinted_head_changes_no_answer(loaded):
    """The head as it is (random: its proposals are rejected), adaptive drafting as by default:
    every row equals greedy decoding alone."""
    from mlx_lm.generate import BatchGenerator

    model = loaded(HYBRID)
    gen = BatchGenerator(model, max_tokens=TOKENS, draft_model=model.make_draft_model(), num_draft_tokens=2)
    got, _ = _decode(gen, model, PROMPTS, TOKENS, hinted=False)
    gen.close()
    _assert_rows_equal_greedy(model, PROMPTS, got, TOKENS)


@pytest.mark.parametrize("family", FAMILIES + [f + ":sliding" for f in _present("exaone_moe")])
def test_the_heads_logits_are_a_single_sequence_pass_over_each_rows_positions(loaded, family):
    """Every batched head pass (drafting rounds, and catch-ups over a row's prompt or after
    rounds without drafts), at each row's last fed slot: the logits of the head run alone over
    that row's pairs (main hidden state at t, token at t + 1) from the start of its prompt, with
    the hidden states of one forward pass of the main model over the row's whole sequence. Also
    a head whose layer slides (K-EXAONE's ``mtp_layer_types``) over a window of 4: its batched
    mask is the batch cache's own, with each row's padding (a single sequence's crashed there)."""
    from mlx_lm_patches.mechanisms.mtp.decoding import family_of, make_mtp_cache, mtp_forward

    model = loaded(family)
    gen = _generator(model)
    drafts_of = lambda: vars(gen._generation_batch)[ATTR].drafts  # noqa: E731
    drafts = drafts_of()
    seen, feed = [], drafts._feed

    def recording_feed(counts, known):
        firsts = [r.first for r in drafts.rows]
        uids = list(gen._generation_batch.uids)
        logits, out = feed(counts, known)
        seen.extend((uid, first, n, known_i, logits[i, 0]) for uid, first, n, known_i, i
                    in zip(uids, firsts, counts, known, range(len(uids))) if n)
        return logits, out

    drafts._feed = recording_feed
    got, _ = _decode(gen, model, PROMPTS[:2], TOKENS, late=PROMPTS[2:3])
    gen.close()
    _assert_rows_equal_greedy(model, PROMPTS[:3], got, TOKENS)
    assert len(seen) > 10
    starts = {}  # uid -> the row's first head position (its last prompt token)
    kind = family_of(model).HIDDEN
    for uid, first, n, known, logits in seen:
        start = starts.setdefault(uid, first)
        last = first + n - 1
        sequence = mx.array(known[:last + 2])[None]
        model(sequence)
        hidden = model.hidden_states()[kind]
        want, _ = mtp_forward(model, hidden[:, start:last + 1], sequence[:, start + 1:last + 2], make_mtp_cache(model))
        gap = mx.abs(want[0, -1] - logits).max().item()
        assert gap < 1e-3, f"row {uid}, position {last}: head logits differ by {gap}"
    assert set(starts.values()) == {0}, f"rows whose head did not start at their prompt: {starts}"


def test_heads_that_cannot_be_batched_say_why_and_decode_plainly(loaded, caplog):
    """A head whose layers keep a ``CacheList`` (GLM-5's indexer keys) cannot be batched: the
    generator decodes without drafting, with one warning naming it, every row still greedy."""
    import logging

    family = next(iter(_present("glm_moe_dsa", "deepseek_v32")), None)
    if family is None:
        pytest.skip("no DeepSeek-V3.2-style model in this mlx-lm")
    model = loaded(family)
    with caplog.at_level(logging.WARNING, logger="mlx_lm_patches"):
        gen = _generator(model)
    said = [r.getMessage() for r in caplog.records if "without drafting" in r.getMessage()]
    assert said and "its MTP head keeps CacheList layers" in said[0], said
    assert ATTR not in vars(gen._generation_batch)
    got, steps = _decode(gen, model, PROMPTS[:2], 6, hinted=False)
    gen.close()
    _assert_rows_equal_greedy(model, PROMPTS[:2], got, 6)


def test_a_head_of_several_layers_is_not_batched(loaded):
    """Heads that draft step k with layer k (MiMo-V2-Flash, Step-3.5) are named as such."""
    from mlx_lm_patches.mechanisms.mtp.batched import unhostable

    family = next(iter(_present("mimo_v2_flash", "step3p5")), None)
    if family is None:
        pytest.skip("no MiMo-V2-Flash or Step-3.5 in this mlx-lm")
    why = unhostable(loaded(family).make_draft_model())
    assert why and re.search(r"drafts with [2-9] layers in turn", why), why


def test_waiting_hidden_states_are_kept_once_and_bounded():
    """A row's waiting hidden states: positions fed again (a hybrid row re-fed after a
    rejection) are not added twice, a gap starts the row again from its new position, and a
    long run without drafts keeps the newest ``KEEP_POSITIONS``."""
    from mlx_lm_patches.mechanisms.mtp.batched import KEEP_POSITIONS, _Row

    def states(start, n):
        return mx.arange(start, start + n, dtype=mx.float32)[:, None]

    row = _Row(10)
    row.add(10, states(10, 3))
    row.add(11, states(11, 4))  # 11, 12 again, then 13, 14
    assert (row.first, row.end) == (10, 15)
    assert [int(h[0].item()) for h in row.take(2)] == [10, 11] and row.first == 12
    row.add(12, states(12, 1))  # already waiting
    assert row.end == 15
    row.add(20, states(20, 2))  # a gap
    assert (row.first, row.end) == (20, 22)
    row.add(22, states(22, KEEP_POSITIONS + 5))
    assert len(row.hidden) == KEEP_POSITIONS and row.end == 22 + KEEP_POSITIONS + 5
    assert int(row.hidden[0][0].item()) == row.first


def test_prompt_passes_are_read_per_row():
    """The hidden states of a prompt batch's passes, per row: passes over the whole batch
    (right-padded, in chunks) or over one row at a time in row order (rows prefilled alone, a
    row in chunks); passes that fit neither give no row any."""
    from mlx_lm_patches.mechanisms.mtp.batched import _rows_of

    def states(rows, start, n):
        return mx.broadcast_to(mx.arange(start, start + n, dtype=mx.float32)[None, :, None], (rows, n, 1))

    whole = _rows_of([states(2, 0, 3), states(2, 3, 2)], [5, 2])
    assert [r[:, 0].tolist() for r in whole] == [[0, 1, 2, 3, 4], [0, 1]]
    alone = _rows_of([states(1, 0, 2), states(1, 2, 1), states(1, 10, 4)], [3, 0, 4])
    assert alone[0][:, 0].tolist() == [0, 1, 2] and alone[1] is None and alone[2][:, 0].tolist() == [10, 11, 12, 13]
    assert _rows_of([states(1, 0, 2), states(1, 2, 2)], [3, 1]) == [None, None]  # a pass across rows
    assert _rows_of([states(1, 0, 3), states(1, 3, 1), states(1, 5, 1)], [3, 1]) == [None, None]  # one left over
