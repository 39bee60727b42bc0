"""The recorder: stands in for the model during a single-sequence prefill and keeps states."""

from typing import Optional, Sequence

from mlx_lm_patches.mechanisms.caches import recurrent_caches
from mlx_lm_patches.mechanisms.prefix_reuse.cuts import cut_points, thin
from mlx_lm_patches.mechanisms.prefix_reuse.settings import max_checkpoints
from mlx_lm_patches.mechanisms.prefix_reuse.trails import Trail, slots_of, checkpoints, set_trails


class Recorder:
    """Stands in for ``model`` while one sequence (a batch of one) goes through it from a known
    history: cuts multi-token passes at :func:`cut_points` (``cut``), keeps the recurrent
    states after each, and publishes trails on the caches (:meth:`publish`, :meth:`close`). A
    pass it cannot follow (another cache list, a batch of several rows, embeddings instead of
    token ids) stops the recording; what was kept stays valid. Everything else is the model's
    own."""

    def __init__(self, model, history: Sequence[int], limit: Optional[int] = None, cut: bool = True):
        self._model = model
        self.cut = cut
        self.tokens = list(history)
        self._pending = []  # token arrays of single-token passes, read when published
        self.caches = None
        self.leaves = []
        self.marks = []  # (position, [slots per recurrent cache])
        self.limit = max_checkpoints() if limit is None else limit
        self.stopped = False

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, cache=None, **kwargs):
        import mlx.core as mx

        if not self._follows(inputs, cache, kwargs):
            self.stop()
            return self._model(inputs, cache=cache, **kwargs)
        if inputs.shape[1] == 1:
            self._pending.append(inputs[0])
            return self._model(inputs, cache=cache)
        self._flush()
        start, length = len(self.tokens), inputs.shape[1]
        cuts = cut_points(start, start + length) if self.cut else []
        bounds = [p - start for p in cuts] + [length]
        outputs, lo = [], 0
        for hi in bounds:
            piece = inputs[:, lo:hi]
            outputs.append(self._model(piece, cache=cache))
            mx.eval([c.state for c in cache])
            self.tokens.extend(piece[0].tolist())
            self.marks.append((len(self.tokens), [slots_of(c) for c in self.leaves]))
            lo = hi
        self.marks = list(thin(self.marks, self.limit))
        self.publish()
        if len(outputs) == 1:
            return outputs[0]
        if all(isinstance(o, mx.array) and o.ndim == 3 for o in outputs):
            return mx.concatenate(outputs, axis=1)
        return outputs[-1]

    def _follows(self, inputs, cache, kwargs) -> bool:
        import mlx.core as mx

        if self.stopped or kwargs or cache is None:
            return False
        if not (isinstance(inputs, mx.array) and inputs.ndim == 2 and inputs.shape[0] == 1):
            return False
        if self.caches is None:
            self._start(cache)
        return cache is self.caches and [id(c) for c in recurrent_caches(cache)] == [id(c) for c in self.leaves]

    def _start(self, caches):
        """First pass: follow these caches, keeping the states they already carry that were
        computed from this history."""
        self.caches = caches
        self.leaves = recurrent_caches(caches)
        self.marks = [
            (pos, states)
            for pos, tokens, states in checkpoints(caches)
            if pos <= len(self.tokens) and list(tokens[:pos]) == self.tokens[:pos]
        ]

    def _flush(self):
        if self._pending:
            import mlx.core as mx

            self.tokens.extend(mx.concatenate(self._pending).tolist())
            self._pending = []

    def publish(self, exact: bool = True) -> None:
        """Put the trails on the caches: the tokens seen, the kept states, and (while every pass
        was followed) the slots as they are now."""
        if self.caches is None:
            return
        self._flush()
        tokens = tuple(self.tokens)
        for j, leaf in enumerate(self.leaves):
            marks = tuple((pos, states[j]) for pos, states in self.marks)
            after = slots_of(leaf) if exact and not self.stopped else None
            set_trails(leaf, [Trail(tokens, marks, after)])

    def stop(self) -> None:
        if not self.stopped and self.caches is not None:
            self.publish(exact=False)
        self.stopped = True

    def close(self) -> None:
        if not self.stopped:
            self.publish()
