"""Batched drafts with controlled acceptance, for tests and benchmarks.

A random draft (a random MTP head above all) almost never agrees with a random model, so the
paths that accepted drafts take go untested. ``hint_proposals`` makes a speculating
``BatchGenerator`` draft as it does - the real draft model or head, with its caches - except that
where ``hint(uid, target)`` holds, the row's true token at position ``target`` (from
``sequences[uid]``, a greedy reference run: prompt then continuation) gets a large bonus before
the draft's sampler picks its proposal.
"""


def hint_proposals(generator, sequences, hint=lambda uid, target: target % 3 != 0):
    """Wrap the drafting of ``generator`` (a ``BatchGenerator`` with a draft); returns it.
    ``sequences``: uid -> the row's reference tokens (set after ``insert`` gives the uids)."""
    import mlx.core as mx

    from mlx_lm_patches.patches.batch_speculative_decoding import ATTR

    drafts = vars(generator._generation_batch)[ATTR].drafts
    propose = drafts.propose

    def hinted_propose(batch, pending, k, sample):
        known = [len(t) + len(p) for t, p in zip(batch.tokens, pending)]
        calls = [0]

        def hinted_sample(logprobs):
            j, bonus = calls[0], mx.zeros(logprobs.shape)
            calls[0] += 1
            for row, (uid, length) in enumerate(zip(batch.uids, known)):
                sequence = sequences.get(uid, ())
                if length + j < len(sequence) and hint(uid, length + j):
                    bonus[row, -1, sequence[length + j]] = 1e4
            return sample(logprobs + bonus)

        return propose(batch, pending, k, hinted_sample)

    drafts.propose = hinted_propose
    return generator
