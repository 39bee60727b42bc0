"""A model wrapper that counts the forward passes run through it, for tests of how many model
calls a path costs."""


class CountingModel:
    """``model``, counting its forward passes (``calls``) and the tokens each one runs
    (``lengths``); ``reads_main_model``: declare it (what a draft that reads the main model's
    caches between passes says to the speculative loop)."""

    def __init__(self, model, reads_main_model=False):
        self.model, self.calls, self.lengths = model, 0, []
        if reads_main_model:
            self.reads_main_model = True

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.lengths.append(args[0].shape[-1])
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)
