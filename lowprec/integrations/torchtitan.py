"""torchtitan: :class:`LowprecConverter`, a model converter that builds lowprec layers in place of Linears.

torchtitan (0.3.0) converts a model by its config tree, before anything is built: a converter subclasses
its ``QuantizationConverter``, declares a nested ``Config`` (``@dataclass(kw_only=True, slots=True)``) and
returns the model config with some ``Linear.Config`` entries replaced by another module's config. A user
registers it by passing its config to a model registry::

    from torchtitan.models.llama3 import model_registry
    spec = model_registry("8B", converters=[LowprecConverter.Config(recipe="mxfp8")])

Each ``Linear.Config`` that lowprec's default policy converts (see ``lowprec.policy``: the LM head and
MoE routers are kept, so are the last blocks a recipe like ``nvfp4`` keeps, and a layer too small to gain
where the recipe runs natively) becomes a :class:`LowprecLinear.Config`, which builds a
``lowprec.nn.Linear`` bound to the recipe; the policy's decisions are made from each config's name and
shape, as ``lowprec.convert`` makes them from the built module's. The converter logs what it converted
and what it kept, and warns when it converted nothing.

Tested on the CPU with torchtitan 0.3.0 and its dependencies, in one process: its llama3 debug model
built with the converter holds the layers ``lowprec.convert`` would have made, computes the same logits
and trains. Not tested: torchtitan's tensor parallelism (its plans shard the Linears' weights as DTensors,
which ``lowprec.nn.Linear`` has not been checked with), its FSDP2 and ``torch.compile`` paths, and grouped
experts (torchtitan's ``GroupedExperts``, which stay as they are). Delayed scaling is refused: each layer
is built alone, and torchtitan's trainer does not make the ranks' delayed scales agree
(``lowprec.distributed.amax.sync_amaxes``).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

from torch import nn

from lowprec import recipes as R
from lowprec._checks import describe, fail
from lowprec.integrations.conversion import NothingConvertedWarning
from lowprec.nn import Linear
from lowprec.policy import Policy, policy_keeps

try:
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.models.common.linear import Linear as TitanLinear
    from torchtitan.protocols.module import Module as TitanModule
    from torchtitan.tools.logging import logger
except ImportError as e:  # pragma: no cover - torchtitan is not one of lowprec's extras
    raise ImportError("lowprec.integrations.torchtitan needs torchtitan (0.3.0) and its dependencies") from e

__all__ = ["LowprecConverter", "LowprecLinear"]

_BLOCK = re.compile(r"^(?:(.*?)\.)?(\d+)\.")
"""A list index in a config's FQN (``layers.3.attention.wqkv``): the blocks' prefix and the block."""


class LowprecLinear(Linear, TitanModule):
    """A ``lowprec.nn.Linear`` that torchtitan builds from its config, with the recipe bound."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanLinear.Config):
        recipe: str = "mxfp8"
        """The lowprec recipe the layer's GEMMs run (a preset name)."""
        min_features: int | None = None
        """Where the recipe runs natively, a dimension under this keeps the layer in high precision (the
        policy's small-layer rule, applied on the device the layer lands on); None: never."""

    def __init__(self, config: Config) -> None:
        Linear.__init__(self, config.in_features, config.out_features, bias=config.bias)
        self.set_recipe(R.get(config.recipe), min_features=config.min_features)


class LowprecConverter(QuantizationConverter):
    """Replaces the ``Linear.Config`` entries lowprec's policy converts with :class:`LowprecLinear.Config`."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "mxfp8"
        """The lowprec recipe (a preset name: ``lowprec formats`` and docs/recipes.md list them)."""
        fqns: list[str] = field(default_factory=list)
        """Convert only Linears whose FQN contains one of these (torchtitan's convention); empty: all."""
        keep_first_blocks: int = 0
        """Keep this many first blocks in high precision."""
        keep_last_blocks: int | None = None
        """Keep this many last blocks in high precision (None: the recipe's own share, e.g. nvfp4's 15%)."""
        skip_small: bool | None = None
        """Keep small layers in high precision: None where the recipe runs natively (lowprec's default),
        True everywhere, False never."""

    def __init__(self, config: Config) -> None:
        self.config = config
        if not isinstance(config.recipe, str):
            fail("recipe", "a lowprec preset name (the built layers look it up by name)", describe(config.recipe),
                 TypeError)
        self.recipe = R.get(config.recipe)
        if self.recipe.uses_delayed_scaling:
            fail("recipe", "a recipe without delayed scaling (torchtitan builds each layer alone and does not "
                 "make the ranks' delayed scales agree)", repr(config.recipe))
        if not isinstance(config.fqns, list) or not all(isinstance(f, str) for f in config.fqns):
            fail("fqns", "a list of FQN substrings", describe(config.fqns), TypeError)
        self.policy = Policy(keep_first_blocks=config.keep_first_blocks, keep_last_blocks=config.keep_last_blocks,
                             skip_small=config.skip_small)
        self.converted: list[str] = []
        self.kept: dict[str, str] = {}
        """Each Linear kept in high precision, by FQN: why."""

    def convert(self, model_config):
        """The model config with each Linear the policy converts replaced; what was kept is logged."""
        found = list(model_config.traverse(TitanLinear.Config))
        blocks = _blocks([fqn for fqn, *_ in found])
        for fqn, config, parent, attr in found:
            why = self._kept(fqn, config, blocks)
            if why is not None:
                self.kept[fqn] = why
                continue
            new = LowprecLinear.Config(in_features=config.in_features, out_features=config.out_features,
                                       bias=config.bias, param_init=config.param_init,
                                       sharding_config=config.sharding_config, recipe=self.recipe.name,
                                       min_features=self.policy.small_rule)
            self.converted.append(fqn)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        self._say(len(found))
        return model_config

    def _kept(self, fqn: str, config, blocks: tuple[str, int] | None) -> str | None:
        """Why the Linear at ``fqn`` stays in high precision, or None to convert it."""
        if isinstance(config, LowprecLinear.Config):
            return f"converted already ({config.recipe})"
        if self.config.fqns and not any(f in fqn for f in self.config.fqns):
            return "not matched by fqns"
        shape = nn.Linear(config.in_features, config.out_features, bias=config.bias, device="meta")
        keep = policy_keeps(self.policy, fqn, shape, embeddings=set(), mha_children=set(), blocks=blocks,
                            last_fraction=self.recipe.hp_last_fraction)
        return None if keep is None else keep.reason

    def _say(self, linears: int) -> None:
        kept = "; ".join(f"{fqn}: {why}" for fqn, why in self.kept.items())
        logger.info(f"lowprec: converted {len(self.converted)} of {linears} Linears to {self.recipe.name}"
                    + (f"; kept in high precision: {kept}" if kept else ""))
        if self.recipe.low_precision and not self.converted:
            warnings.warn(NothingConvertedWarning(
                f"lowprec: LowprecConverter: {self.recipe.name} converted none of the model's {linears} Linears, "
                f"so it trains in high precision{': ' + kept if kept else ''}"), stacklevel=3)


def _blocks(fqns: list[str]) -> tuple[str, int] | None:
    """The transformer blocks as lowprec's policy names them, (prefix, count), from the Linears' FQNs: the
    list that holds the most of them."""
    seen: dict[str, set[int]] = {}
    for fqn in fqns:
        if (m := _BLOCK.match(fqn)) is not None:
            seen.setdefault(m.group(1) or "", set()).add(int(m.group(2)))
    if not seen:
        return None
    prefix = max(seen, key=lambda p: len(seen[p]))
    return prefix, max(seen[prefix]) + 1
