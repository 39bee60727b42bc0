"""``mlx_lm.convert``, ``mlx_lm.fuse`` and ``mlx_lm.utils.save_model`` write the MTP head that
``mtp-heads-kept`` attached at load, quantized as mlx-lm quantizes the backbone's layers.

Bug
    The kept head (``model.mtp``) lies outside the parameter tree, and mlx-lm saves the tree
    only: ``mlx_lm.convert [-q]``, ``mlx_lm.fuse`` and ``save_model`` write a checkpoint without
    it, and ``--draft-model mtp`` has nothing to draft with. Writing ``mtp.*`` tensors into the
    weight files would break stock mlx-lm (qwen3_next rejects MLX-format ``mtp.*`` keys).

Fix
    While ``convert`` (or ``fuse``) runs, its ``load`` puts the head into the tree (as ``mtp``),
    so mlx-lm's own code casts, quantizes (bits, group size, mode, predicates; per-layer entries
    under ``mtp.<path>``) and dequantizes it as it does the backbone; mixed recipes see head
    layer ``i`` as backbone layer ``num_hidden_layers + i``. ``save_model`` takes the head out of
    the tree before the shards are written and writes it to an ``mtp.safetensors`` sidecar,
    outside every release's weight glob and index, so stock mlx-lm loads the folder unchanged;
    ``mtp-heads-kept`` reads it back. A head declared but not kept makes ``convert`` warn.

Retire
    With ``mtp-heads-kept``: when mlx-lm keeps (and so saves) MTP heads itself in every
    supported release.

Metal
    Saving only; quantization is mlx-lm's own.
"""

import contextvars

from mlx_lm_patches.engine.contract import NotNeeded, Outcome

UTILS = "mlx_lm.utils"
CONVERT = "mlx_lm.convert"
FUSE = "mlx_lm.fuse"

_converting = contextvars.ContextVar("mlx_lm_patches_mtp_converting", default=False)


def _writing(wrapped, instance, args, kwargs):
    """``convert`` and ``fuse``'s ``main``: the model they load is written out with its head."""
    token = _converting.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _converting.reset(token)


def _load_for_writing(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.mtp.heads import into_tree

    result = wrapped(*args, **kwargs)
    if _converting.get():
        model = result[0] if isinstance(result, tuple) else result
        if not into_tree(model):
            status = model.__dict__.get("mtp_status") if isinstance(model, dict) else None
            if status and status != "no MTP head in this checkpoint":
                import warnings

                warnings.warn(f"the converted model will have no MTP head: {status}", stacklevel=2)
    return result


def _head_path(path, layers_prefix, n_layers):
    """A head layer's path as the backbone layer a mixed recipe should see it as."""
    rest = path[len("mtp."):]
    if rest.startswith("layers."):
        index, _, tail = rest[len("layers."):].partition(".")
        if index.isdigit():
            return f"{layers_prefix}.{n_layers + int(index)}.{tail}"
    return f"{layers_prefix}.{n_layers}.{rest}"


def _mixed_recipe(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.mtp.heads import TREE_KEY

    model = args[1] if len(args) > 1 else kwargs["model"]
    head = model.pop(TREE_KEY, None)  # the recipe is measured on the backbone alone
    try:
        predicate = wrapped(*args, **kwargs)
        if head is None:
            return predicate
        first = model.layers[0]
        found = next((name for name, module in model.named_modules() if module is first), "layers.0")
        layers_prefix = found.rsplit(".", 1)[0]
        n_layers = len(model.layers)
    finally:
        if head is not None:
            model[TREE_KEY] = head

    def mixed_with_head(path, module, *rest):
        if path.startswith("mtp."):
            path = _head_path(path, layers_prefix, n_layers)
        return predicate(path, module, *rest)

    return mixed_with_head


def _quantizing_head_as_its_kind(wrapped, instance, args, kwargs):
    """The family's own ``quant_predicate`` (no predicate given) sees a head layer's path as the
    backbone layer of the same kind where the family says which (``quant_path``: a predicate
    that looks a layer up by its index, e.g. Ling 3.0's linear vs latent attention)."""
    from mlx_lm_patches.mechanisms.calls import bind_arguments
    from mlx_lm_patches.mechanisms.mtp.families import family_of
    from mlx_lm_patches.mechanisms.mtp.heads import TREE_KEY

    call = bind_arguments(wrapped, args, kwargs)
    model = call.arguments.get("model")
    family = family_of(model)
    own = getattr(model, "quant_predicate", None)
    if (call.arguments.get("quant_predicate") is None and own is not None and family is not None
            and isinstance(model, dict) and TREE_KEY in model):
        call.arguments["quant_predicate"] = lambda path, module: own(family.quant_path(model, path), module)
    return wrapped(*call.args, **call.kwargs)


def _save_model(wrapped, instance, args, kwargs):
    from mlx_lm_patches.mechanisms.mtp.heads import out_of_tree, save_sidecar

    save_path = args[0] if args else kwargs["save_path"]
    model = args[1] if len(args) > 1 else kwargs["model"]
    head = out_of_tree(model)
    result = wrapped(*args, **kwargs)
    if head is not None:
        save_sidecar(save_path, head)
    return result


def probe():
    import sys

    try:
        from mlx_lm.models import qwen3_next
    except ImportError:
        return NotNeeded("qwen3_next (mlx_lm.models.qwen3_next) missing in this mlx-lm: not needed")
    if hasattr(qwen3_next.Model, "mtp_forward") or hasattr(qwen3_next.Model, "mtp"):
        return None  # mlx-lm keeps the head in the parameter tree itself: saved with it
    save_model = getattr(sys.modules.get(UTILS), "save_model", None)
    if save_model is None:
        return NotNeeded("save_model missing in this mlx-lm's mlx_lm.utils: not needed")
    return "save_model (mlx_lm.utils) writes model.parameters() only; an MTP head kept at load is not saved"


def apply(p):
    # Anchored on mlx_lm.convert, not mlx_lm.utils: mlx_lm/__init__ imports convert first, which
    # imports utils half-way through its own import (before ``convert`` is defined); any import
    # of mlx-lm runs mlx_lm/__init__, so save_model is patched for fuse and direct calls too.
    p.wrap(f"{CONVERT}:convert", _writing)
    p.wrap(f"{CONVERT}:load", _load_for_writing)
    p.wrap(f"{CONVERT}:mixed_quant_predicate_builder", _mixed_recipe)
    p.wrap(f"{CONVERT}:quantize_model", _quantizing_head_as_its_kind)
    p.wrap(f"{UTILS}:save_model", _save_model)
    p.wrap(f"{FUSE}:main", _writing)  # deferred until mlx_lm.fuse is imported
    p.wrap(f"{FUSE}:load", _load_for_writing)


def scenario():
    """An HF-layout Qwen3-Next checkpoint with an MTP head, converted with ``mlx_lm.convert``
    (4-bit and unquantized): the converted folder carries the head, which loads back and
    drafts; the weight files stock reads carry no ``mtp.*`` key."""
    import contextlib
    import sys
    import tempfile
    from pathlib import Path

    from mlx_lm_patches.selftest.mtp_checkpoints import write_mtp_checkpoint
    from mlx_lm_patches.mechanisms.probing.decoded import prompt_tokens
    from mlx_lm_patches.selftest.scenarios import greedy, speculative_greedy

    from mlx_lm import load
    from mlx_lm.convert import convert

    details = []
    with tempfile.TemporaryDirectory() as tmp:
        written = write_mtp_checkpoint(tmp, "qwen3_next", form="hf", dtype="float32")
        for quantize in (False, True):
            out = Path(tmp) / f"converted-{'q4' if quantize else 'fp'}"
            what = f"mlx_lm.convert{' -q' if quantize else ''}"
            try:
                with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints progress
                    convert(str(written.folder), mlx_path=str(out), quantize=quantize, dtype="float32")
            except Exception as exc:
                return Outcome.failure(f"{what} of a qwen3_next HF checkpoint with an MTP head", exc)
            import mlx.core as mx

            stock_keys = [k for f in out.glob("model*.safetensors") for k in mx.load(str(f)) if "mtp." in k]
            if stock_keys:
                return Outcome.failure(f"{what}: mtp.* tensors in the files stock mlx-lm reads: {stock_keys[:3]}")
            if not (out / "mtp.safetensors").exists():
                return Outcome.failure(f"{what} wrote no MTP head (no mtp.safetensors; files: "
                                       f"{sorted(p.name for p in out.iterdir() if p.suffix == '.safetensors')})")
            model = load(str(out))[0]
            if getattr(model, "mtp", None) is None:
                return Outcome.failure(f"{what}: the converted head does not load: "
                                       f"{getattr(model, 'mtp_status', 'no mtp_status')}")
            prompt = prompt_tokens(10)
            try:
                problem = greedy(model, prompt).compare(speculative_greedy(model, model.make_draft_model(), prompt))
            except TypeError as exc:
                if "gather_qmm" not in str(exc) or "global_scale" not in str(exc):
                    raise
                details.append(f"{what}: head in mtp.safetensors, loaded back ({model.mtp_status}); not run: "
                               "stock mlx-lm's quantized MoE layers need mx.gather_qmm(global_scale=), "
                               "which this mlx lacks")
                continue
            if problem:
                return Outcome.failure(f"{what}: MTP speculation differs from greedy: {problem}")
            details.append(f"{what}: head in mtp.safetensors, loaded back ({model.mtp_status}); "
                           "MTP speculation equals greedy")
    return Outcome(True, "mlx_lm.convert keeps the MTP head (sidecar), stock files unchanged", details)
