"""ModelConfig: one description of every Kimi-K3-family network.

Every difference between Kimi-K3 and Kimi-Linear is a field here, never a code fork: the layer pattern,
AttnRes, the KDA gate form and output gate, MLA q_lora_rank and output gate, the activation, LatentMoE and
the router. A config comes from a preset (`k3core/presets/*.yaml`), a YAML file, or a Hugging Face
`config.json` (`model_type` `kimi_linear`, or `kimi_k3` with the language model under `text_config`).

`python -m k3core.sizing --model k3 --tp 8` prints parameter counts and per-GPU state sizes.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

PRESET_DIR = Path(__file__).parent / "presets"

EXPERT_FORMATS = ("bf16", "mxfp4")

LayerKind = Literal["kda", "mla"]
MlpKind = Literal["dense", "moe"]


class ConfigError(ValueError):
    """A config field is missing or invalid; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    # trunk
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[LayerKind, ...]          # per layer, 0-based
    mlp_types: tuple[MlpKind, ...]              # per layer, 0-based
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1 << 20
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    # activation of every GLU in the model: "silu" (SwiGLU) or "situ" (SiTU-GLU with two soft-clip betas)
    activation: Literal["silu", "situ"] = "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0

    # dense FFN (first layers)
    intermediate_size: int = 0

    # KDA
    kda_num_heads: int = 0
    kda_head_dim: int = 128
    conv_kernel_size: int = 4
    kda_gate: Literal["softplus", "lower_bound"] = "softplus"
    kda_gate_lower_bound: float = -5.0
    kda_output_gate: Literal["low_rank", "full_rank"] = "low_rank"

    # MLA
    mla_num_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = False
    mla_latent_norm_eps: float = 1e-6            # HF builds q_a/kv_a layernorms with its default eps

    # MoE
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    router_scoring: Literal["sigmoid", "softmax"] = "sigmoid"
    router_correction_bias: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    moe_latent_size: int | None = None           # LatentMoE: experts compute at this width; None = full width
    moe_latent_norm: bool = False                # RMSNorm on the combined latent output
    num_expert_group: int = 1                    # grouped top-k (DeepSeek-V3 style): experts in this many groups,
    topk_group: int = 1                          # ... and the top-k chosen within the best topk_group of them
    # routed-expert storage: "bf16" (the model dtype) or "mxfp4" (packed E2M1 codes + E8M0 scales per 32 inputs,
    # as the K3 checkpoint ships them; k3core.model.mxfp4)
    expert_format: Literal["bf16", "mxfp4"] = "bf16"

    # Attention Residuals
    attn_res: bool = False
    attn_res_block_size: int = 12                # in decoder layers

    name: str = "custom"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived --------------------------------------------------------------------------------
    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "kda"]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "mla"]

    @property
    def kda_proj_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_width(self) -> int:
        """Width of one cached MLA token: the normalised KV latent plus the shared (unrotated) key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_width(self) -> int:
        """Input/output width of a routed expert (the latent width under LatentMoE)."""
        return self.moe_latent_size if self.moe_latent_size is not None else self.hidden_size

    @property
    def num_attn_res_blocks(self) -> int:
        """Rows of the AttnRes bank: one seal per block start."""
        return -(-self.num_layers // self.attn_res_block_size) if self.attn_res else 0

    # ---- validation -----------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"invalid config field `{name}`: {why}")

        for name in ("vocab_size", "hidden_size", "num_layers"):
            need(getattr(self, name) > 0, name, "must be a positive integer")
        need(len(self.layer_types) == self.num_layers, "layer_types",
             f"has {len(self.layer_types)} entries but num_layers is {self.num_layers}")
        need(all(k in ("kda", "mla") for k in self.layer_types), "layer_types", "entries must be 'kda' or 'mla'")
        need(len(self.mlp_types) == self.num_layers, "mlp_types",
             f"has {len(self.mlp_types)} entries but num_layers is {self.num_layers}")
        need(all(k in ("dense", "moe") for k in self.mlp_types), "mlp_types", "entries must be 'dense' or 'moe'")
        need(self.activation in ("silu", "situ"), "activation", f"must be 'silu' or 'situ', got {self.activation!r}")
        if self.activation == "situ":
            need(self.situ_beta > 0, "situ_beta", "must be positive")
            need(self.situ_linear_beta is None or self.situ_linear_beta > 0, "situ_linear_beta",
                 "must be positive or null")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")
        if "dense" in self.mlp_types:
            need(self.intermediate_size > 0, "intermediate_size", "must be positive when a layer is dense")
        if "kda" in self.layer_types:
            need(self.kda_num_heads > 0, "kda_num_heads", "must be positive when the model has KDA layers")
            need(self.kda_head_dim > 0, "kda_head_dim", "must be positive")
            need(self.conv_kernel_size >= 1, "conv_kernel_size", "must be at least 1")
            need(self.kda_gate in ("softplus", "lower_bound"), "kda_gate", "must be 'softplus' or 'lower_bound'")
            need(self.kda_gate != "lower_bound" or self.kda_gate_lower_bound < 0, "kda_gate_lower_bound",
                 "must be negative (it bounds a log-decay)")
            need(self.kda_output_gate in ("low_rank", "full_rank"), "kda_output_gate",
                 "must be 'low_rank' or 'full_rank'")
        if "mla" in self.layer_types:
            need(self.mla_num_heads > 0, "mla_num_heads", "must be positive when the model has MLA layers")
            need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", "must be positive or null")
            for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                need(getattr(self, name) > 0, name, "must be positive")
            need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be non-negative")
        if "moe" in self.mlp_types:
            need(self.num_experts > 0, "num_experts", "must be positive when a layer is MoE")
            need(0 < self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                 f"must be in 1..num_experts ({self.num_experts})")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive")
            need(self.num_shared_experts >= 0, "num_shared_experts", "must be non-negative")
            need(self.router_scoring in ("sigmoid", "softmax"), "router_scoring", "must be 'sigmoid' or 'softmax'")
            need(self.moe_latent_size is None or self.moe_latent_size > 0, "moe_latent_size",
                 "must be positive or null")
            need(not self.moe_latent_norm or self.moe_latent_size is not None, "moe_latent_norm",
                 "needs moe_latent_size (the norm acts on the latent output)")
            need(self.num_expert_group >= 1 and self.num_experts % self.num_expert_group == 0, "num_expert_group",
                 f"must be a positive divisor of num_experts ({self.num_experts})")
            need(1 <= self.topk_group <= self.num_expert_group, "topk_group",
                 f"must be in 1..num_expert_group ({self.num_expert_group})")
            need(self.num_experts_per_token <= self.topk_group * (self.num_experts // self.num_expert_group),
                 "topk_group", f"leaves fewer experts than num_experts_per_token ({self.num_experts_per_token}) "
                 "to choose from")
            need(self.expert_format in EXPERT_FORMATS, "expert_format",
                 f"must be one of {', '.join(EXPERT_FORMATS)}, got {self.expert_format!r}")
            if self.expert_format == "mxfp4":
                need(self.moe_intermediate_size % 32 == 0 and self.expert_width % 32 == 0, "expert_format",
                     f"mxfp4 needs moe_intermediate_size ({self.moe_intermediate_size}) and the expert width "
                     f"({self.expert_width}) to be multiples of 32 (one E8M0 scale per 32 inputs); use bf16")
        if self.attn_res:
            need(self.attn_res_block_size > 0, "attn_res_block_size", "must be positive")

    # ---- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["mlp_types"] = list(self.mlp_types)
        out.pop("extra")
        return out

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str = "custom") -> "ModelConfig":
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"invalid config field `{unknown[0]}`: unknown field (known: {', '.join(sorted(known))})")
        data.setdefault("name", name)
        data = _expand_patterns(data)
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"invalid config: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as handle:
            data = yaml.safe_load(handle)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a model YAML must be a mapping of config fields")
        return cls.from_dict(data, name=Path(path).stem)

    @classmethod
    def from_hf(cls, source: str | os.PathLike | dict[str, Any]) -> "ModelConfig":
        from k3core.hf_config import parse_hf_config  # a separate module: the HF field mapping is one idea
        if isinstance(source, dict):
            return parse_hf_config(source)
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
            if not path.is_file():
                raise ConfigError(f"{path.parent} has no config.json; put the model's config.json beside its weights")
        try:
            with open(path, "rb") as handle:
                data = json.loads(handle.read().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"{path} is not readable JSON ({str(exc).splitlines()[0]}); "
                              "re-download or fix it") from None
        try:
            return parse_hf_config(data, name=path.parent.name)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        path = PRESET_DIR / f"{name}.yaml"
        if not path.exists():
            raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(list_presets())}")
        return cls.from_yaml(path)


def list_presets() -> list[str]:
    """Architecture presets (random weights): the YAML files of PRESET_DIR."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def list_checkpoint_presets() -> list[str]:
    """Trained checkpoints shipped in the package: the directories of PRESET_DIR that hold a config.json."""
    return sorted(p.name for p in PRESET_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model(model: str | os.PathLike) -> str:
    """The directory of a shipped checkpoint named by `model` (e.g. "k3-demo"); any other value unchanged.
    A path that exists wins over a shipped name."""
    text = str(model)
    if text in list_checkpoint_presets() and not Path(text).exists():
        return str(PRESET_DIR / text)
    return text


def kimi_layer_pattern(num_layers: int, period: int = 4) -> list[LayerKind]:
    """The Kimi pattern: MLA at 1-based multiples of `period` and at the last layer, KDA elsewhere."""
    return ["mla" if (i + 1) % period == 0 or i == num_layers - 1 else "kda" for i in range(num_layers)]


def _expand_patterns(data: dict[str, Any]) -> dict[str, Any]:
    """Allow compact YAML: `layer_types: kimi` (3 KDA : 1 MLA, last MLA) and `mlp_types: {first_dense_layers: N}`."""
    num_layers = data.get("num_layers")
    if data.get("layer_types") == "kimi" and isinstance(num_layers, int):
        data["layer_types"] = kimi_layer_pattern(num_layers)
    mlp_types = data.get("mlp_types")
    if isinstance(mlp_types, dict) and isinstance(num_layers, int):
        first = int(mlp_types.get("first_dense_layers", 0))
        data["mlp_types"] = ["dense" if i < first else "moe" for i in range(num_layers)]
    for key in ("layer_types", "mlp_types"):
        if isinstance(data.get(key), list):
            data[key] = tuple(data[key])
    return data


def load_config(model: str | os.PathLike) -> ModelConfig:
    """A preset name, a YAML file, a `config.json`, or a checkpoint directory holding one."""
    text = resolve_model(model)
    if text in list_presets():
        return ModelConfig.preset(text)
    path = Path(text)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return ModelConfig.from_yaml(path)
    if path.is_dir() or (path.suffix == ".json" and path.exists()):
        return ModelConfig.from_hf(path)
    raise ConfigError(
        f"model {text!r} is neither a preset ({', '.join(list_checkpoint_presets() + list_presets())}) nor a "
        "checkpoint directory, YAML file or config.json that exists")


def _sizing_report() -> None:
    """`python -m k3core.config --model k3 --tp 8` (the command issue 24 names) would otherwise exit 0 having
    printed nothing: the sizing report lives in k3core.sizing (which imports this module), and this gives it too."""
    from k3core.sizing import main  # noqa: PLC0415  (run time only: sizing imports config)
    main()


if __name__ == "__main__":
    _sizing_report()
