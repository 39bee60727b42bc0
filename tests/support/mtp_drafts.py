"""An MTP draft with controlled acceptance, for tests and benchmarks.

A random MTP head almost never agrees with a random model, so speculative decoding with it
rejects every proposal and the paths that accepted tokens take (a main forward that keeps
several tokens, the draft catching its MTP cache up over them) go untested. ``hinted_draft``
returns the model's own MTP draft - every call runs the real head, with its cache, recycling
and re-synchronisation - except that for the proposals ``hint(target)`` selects, the true next
token (from ``sequence``, a reference greedy run) gets a large logit bonus. Proposals it does
not select stay the head's own, so rounds mix accepted and rejected tokens.
"""


def hinted_draft(model, sequence, hint=lambda target: target % 3 != 0, draft=None, **kwargs):
    """``draft`` (default ``model.make_draft_model(**kwargs)``) made to propose
    ``sequence[target]`` where ``hint(target)`` (``target``: the position the proposal is for).
    ``draft`` may be an instance of a subclass of ``MTPDraft`` (e.g. one that records what the
    head proposed before the hint)."""
    import mlx.core as mx

    draft = draft if draft is not None else model.make_draft_model(**kwargs)
    base = type(draft)

    class Hinted(base):
        def __call__(self, inputs, cache=None, **call_kwargs):
            state = cache[0]
            committed = self.capture.committed(state.since)
            step = 0 if state.round_of != committed else state.step + 1
            logits = super().__call__(inputs, cache=cache, **call_kwargs)
            state.step = step
            target = (committed or 0) + 1 + step  # the loop handed us position `committed`
            if committed and target < len(sequence) and hint(target):
                bonus = mx.zeros(logits.shape[-1]).at[sequence[target]].add(1e4)
                logits = mx.concatenate([logits[:, :-1], logits[:, -1:] + bonus], axis=1)
            return logits

    draft.__class__ = Hinted
    return draft


def recording_draft(model, proposals, **kwargs):
    """The model's MTP draft (``MTPDraft(model, **kwargs)``), appending ``(committed, logits)``
    to ``proposals`` for the first proposal of every round after the first token: ``committed``
    is how many positions the main model had committed, ``logits`` the head's row for the
    proposal (made from the main hidden state at ``committed - 1`` and the token at
    ``committed``)."""
    from mlx_lm_patches.mechanisms.mtp.decoding import MTPDraft

    class Recording(MTPDraft):
        def __call__(self, inputs, cache=None, **call_kwargs):
            committed = self.capture.committed(cache[0].since)
            new_round = cache[0].round_of != committed
            logits = super().__call__(inputs, cache=cache, **call_kwargs)
            if new_round and committed:
                proposals.append((committed, logits[0, -1]))
            return logits

    return Recording(model, **kwargs)
