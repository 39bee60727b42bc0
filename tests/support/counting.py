"""A model wrapper that counts the forward passes run through it, for tests of how many model
calls a path costs (and, optionally, makes each token it runs cost time)."""

import time


class CountingModel:
    """``model``, counting its forward passes (``calls``) and the shape of the inputs of each
    (``shapes``; ``lengths``: their tokens); ``reads_main_model``: declare it (what a draft that
    reads the main model's caches between passes says to the speculative loop);
    ``seconds_per_token``: each pass sleeps that long per token it runs first."""

    def __init__(self, model, reads_main_model=False, seconds_per_token=0.0):
        self.model, self.calls, self.shapes = model, 0, []
        self.seconds_per_token = seconds_per_token
        if reads_main_model:
            self.reads_main_model = True

    @property
    def lengths(self):
        return [shape[-1] for shape in self.shapes]

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.shapes.append(tuple(args[0].shape))
        if self.seconds_per_token:
            time.sleep(self.seconds_per_token * args[0].shape[-1])
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)
