"""Checkpoint tensor names and layouts: what several families' ``convert`` and
``split_checkpoint`` share."""

import re

from mlx_lm_patches.mechanisms.mtp.families.base import declared_layers


_PER_EXPERT = re.compile(r"^(layers\.\d+\.(?:mlp|mixer))\.experts\.(\d+)\.(\w+_proj)\.(weight|scales|biases)$")


def set_aside_expert(key, value, experts) -> bool:
    """Collect a per-expert tensor into ``experts[(prefix, proj, leaf)][index]`` (for
    ``stack_experts``); False if ``key`` is not one."""
    per_expert = _PER_EXPERT.match(key)
    if not per_expert:
        return False
    prefix, index, proj, leaf = per_expert.groups()
    experts.setdefault((prefix, proj, leaf), {})[int(index)] = value
    return True


def with_stacked_experts(tensors, rename=None):
    """``tensors`` with per-expert tensors stacked as mlx-lm's own ``sanitize`` stacks them."""
    out, experts = {}, {}
    for key, value in tensors.items():
        if not set_aside_expert(key, value, experts):
            out[key] = value
    return stack_experts(out, experts, rename=rename)


def stack_experts(out, experts, rename=None):
    import mlx.core as mx

    for (prefix, proj, leaf), by_index in experts.items():
        name = (rename or {}).get(proj, proj)
        out[f"{prefix}.switch_mlp.{name}.{leaf}"] = mx.stack([by_index[e] for e in sorted(by_index)])
    return out


def layers_past(weights, depth, name=lambda i, rest: f"{i}.{rest}"):
    """``(backbone, past)``: the checkpoint tensors of layers ``model.layers.{depth + i}`` set apart
    as ``name(i, rest of the key)`` (the layers after the backbone's last, numbered from 0)."""
    backbone, past = {}, {}
    for key, value in weights.items():
        match = re.match(r"^model\.layers\.(\d+)\.(.+)$", key)
        if match and int(match.group(1)) >= depth:
            past[name(int(match.group(1)) - depth, match.group(2))] = value
        else:
            backbone[key] = value
    return backbone, past


def through_stock_sanitize(tensors, stock_sanitize, stand_in, back):
    """``tensors`` with those ``stand_in(key)`` renames (to a backbone name the release's own
    ``sanitize`` converts) run through ``stock_sanitize`` and renamed back by ``back(key)`` (None:
    not the head's); the others as they are."""
    rest, renamed = {}, {}
    for key, value in tensors.items():
        name = stand_in(key)
        if name is None:
            rest[key] = value
        else:
            renamed[name] = value
    for key, value in stock_sanitize(renamed).items():
        name = back(key)
        if name is not None:
            rest[name] = value
    return rest


DEPTHS = re.compile(r"^depths\.(\d+)\.")  # the head's MTP layers after the first: depths.{i-1}.*


def depth_count(weights, config):
    """How many MTP layers a head that drafts with each in turn has: those of the (converted)
    weights, else those the config declares, at least one."""
    if weights:
        return 1 + len({m.group(1) for k in weights for m in [DEPTHS.match(k)] if m})
    return max(declared_layers(config), 1)


def with_depths(build_one, count):
    """The head: MTP layer 0 (``build_one(0)``) with the later ones as ``depths``."""
    head = build_one(0)
    if count > 1:
        head.depths = [build_one(i) for i in range(1, count)]
    return head


def as_depth(index, tail, top):
    """Where a checkpoint tensor of MTP layer ``index`` (``tail``: its name inside the layer)
    goes in the head: layer 0's at the top (``top``: fusion and final-norm names) or under
    ``layers.0.``; later layers' the same under ``depths.{index-1}.``."""
    inner = tail if tail.startswith(top) else f"layers.0.{tail}"
    return inner if index == 0 else f"depths.{index - 1}.{inner}"
