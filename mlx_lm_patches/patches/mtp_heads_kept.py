"""Checkpoints with multi-token-prediction (MTP) tensors load, with the backbone intact and the
MTP head kept as ``model.mtp`` (the families of ``mechanisms/mtp/families/``: Qwen3-Next,
Qwen3.5/3.6, Nemotron-H, the DeepSeek-V3 layout, MiMo, ERNIE 4.5 MoE, K-EXAONE, MiMo-V2-Flash,
Step-3.5-Flash, Ling 3.0, LongCat-Flash and LongCat-Flash-Lite).

Bug
    mlx-lm has no module for the MTP head, and its ``sanitize`` methods handle the MTP tensors
    badly: loads fail with ``Received N parameters not in model`` (qwen3_next MLX weights,
    nemotron_h on older releases, deepseek_v3 and older deepseek_v32 at any depth but 61),
    qwen3_5 on some releases takes MLX weights for HF ones and adds 1.0 to every backbone norm
    (a silently corrupted model), and everywhere else the head is dropped without a word; an
    ``mtp.safetensors`` sidecar is never read. Details: docs/mtp.md.

Fix
    Wrap each family's ``Model.sanitize`` so the MTP tensors are set aside before the stock code
    sees them (that alone removes the crash and the corruption; the DeepSeek-V3 layout's head
    layers go through the release's own ``sanitize`` under an index it processes, so they are
    converted as the backbone's), and wrap ``mlx_lm.utils.load_model`` (every load path) to build
    the head from the family's own blocks (``mechanisms/mtp/``), convert the tensors to mlx-lm's
    layout, quantize exactly the layers stored quantized and load it strictly, outside the
    parameter tree. ``model.mtp_status`` says what happened; ``revert()`` takes the decoding
    interface off the models loaded meanwhile (the head stays, as loaded data).

Retire
    When mlx-lm keeps MTP heads itself in every supported release.

Metal
    Loading only; no kernel involved.
"""

from mlx_lm_patches.engine.contract import NotNeeded, Outcome

UTILS = "mlx_lm.utils"


def _sanitize_without_mtp(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.mtp.families import family_of
    from mlx_lm_patches.mechanisms.mtp.heads import SOURCE, split, stash

    weights = args[0] if args else kwargs.pop("weights")
    backbone, mtp = split(weights)
    family = family_of(instance)
    if family is not None:
        def stock(w):
            return wrapped(w, *args[1:], **kwargs)

        if mtp:  # the release's own conversion (e.g. fp8) for the head too
            mtp = family.sanitize_head(instance, mtp, stock)
        backbone, layer = family.split_checkpoint(instance, backbone, stock)  # a head past the backbone's last layer
        if layer:
            instance.__dict__[SOURCE] = family.source(instance)
            mtp = dict(mtp, **layer)
        backbone = family.for_stock_sanitize(instance, backbone, mtp)  # (Qwen3.5: an MTP tensor as stock's HF sign)
    if instance is not None:
        stash(instance, mtp)
    return wrapped(backbone, *args[1:], **kwargs)


def _load_model_with_mtp(wrapped, instance, args, kwargs, track=None):
    from mlx_lm_patches.mechanisms.mtp.heads import attach

    model, config = wrapped(*args, **kwargs)
    model_path = args[0] if args else kwargs.get("model_path")
    lazy = args[1] if len(args) > 1 else kwargs.get("lazy", False)
    attach(model, model_path, config, lazy=lazy)
    from mlx_lm_patches.mechanisms.mtp.families import family_of

    if family_of(model) is not None:
        from mlx_lm_patches.mechanisms.mtp.decoding import add_interface

        add_interface(model, track)
    return model, config


def _shard_with_head(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.calls import bind_arguments
    from mlx_lm_patches.mechanisms.mtp.sharding import shard_head

    result = wrapped(*args, **kwargs)
    function = getattr(wrapped, "__func__", None)
    if function is None:  # called through the class by another family's shard (LongCat-Flash-Lite's
        return result     # calls LongcatFlashLM.shard(self, group)): the outer call splits the head
    shard_head(function, instance, bind_arguments(wrapped, args, kwargs).arguments.get("group"))
    return result


def probe():
    try:
        from mlx_lm.models import qwen3_next
    except ImportError:
        return NotNeeded("qwen3_next (mlx_lm.models.qwen3_next) missing in this mlx-lm: not needed")

    if hasattr(qwen3_next.Model, "mtp_forward") or hasattr(qwen3_next.Model, "mtp"):
        return None
    return "qwen3_next has no MTP module: MTP tensors crash the load or are dropped"


def apply(p):
    import importlib.util

    from mlx_lm_patches.mechanisms.mtp.families import model_types, sharded_types, subclassed_types

    for family in model_types():  # every family whose head is kept (its sanitize is a declared target)
        if importlib.util.find_spec(f"mlx_lm.models.{family}") is None:
            continue
        if family in subclassed_types():  # its own sanitize if it has one, else its base's (wrapped)
            p.wrap_if_present(f"mlx_lm.models.{family}:Model.sanitize", _sanitize_without_mtp, own=True)
        else:
            p.wrap(f"mlx_lm.models.{family}:Model.sanitize", _sanitize_without_mtp)
    for family in sharded_types():  # the head's layers sharded as the backbone's (where defined)
        if importlib.util.find_spec(f"mlx_lm.models.{family}") is not None:
            p.wrap_if_present(f"mlx_lm.models.{family}:Model.shard", _shard_with_head, own=True)
    track = p.track  # revert takes the interface (and the draft's class swap) off loaded models

    def load_model(wrapped, instance, args, kwargs):
        return _load_model_with_mtp(wrapped, instance, args, kwargs, track)

    p.wrap(f"{UTILS}:load_model", load_model)


def scenario():
    """A Qwen3-Next checkpoint carrying an MTP head loads; head and backbone round-trip."""
    import tempfile

    from mlx_lm_patches.selftest.mtp_checkpoints import check_loaded, write_mtp_checkpoint

    from mlx_lm import load

    details = []
    with tempfile.TemporaryDirectory() as tmp:
        for form in ("mlx", "hf"):
            written = write_mtp_checkpoint(tmp, "qwen3_next", form=form)
            try:
                model, _ = load(str(written.folder))
            except Exception as exc:
                return Outcome.failure(f"qwen3_next {form}-format checkpoint with an MTP head", exc)
            problem = check_loaded(model, written)
            if problem:
                return Outcome.failure(f"qwen3_next {form}-format checkpoint: {problem}")
            details.append(f"qwen3_next {form} format: backbone intact, all MTP tensors kept")
    return Outcome(True, "MTP heads kept at load; backbone intact", details)

