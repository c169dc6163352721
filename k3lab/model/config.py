"""`K3Config`: the K3 architecture's shape, with the released config's field names (K3 report, Table 1),
and its named presets.

    k3-full   K3 itself: d 7168, 93 layers (69 KDA + 24 Gated MLA), 896 experts top-16, 2.78T / 104.2B
    k3-1b     the same architecture at ~1B total parameters, for one GPU
    k3-tiny   the same architecture at a size where a CPU step takes well under a second (tests, CPU book)

Fields without a released name (the KDA gate bound, gate rank and chunk, the LatentMoE width, the
balancer) are prefixed ``kda_`` / ``moe_`` and named after what they set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from k3lab.kda.checks import check_chunk_size
from k3lab.kda.gate import check_lower_bound
from k3lab.moe.activation import BETA1, BETA2

BALANCERS = ("qb", "sign", "aux", "none")


def k3_full_attn_layers(num_hidden_layers: int = 93, every: int = 4) -> list[int]:
    """The 1-based indices of the Gated MLA layers: every ``every``-th layer and the last one
    ([4, 8, ..., 92, 93] for K3's 93 layers: 23 x (3 KDA + 1 MLA) + a final MLA).

    Raises:
        ValueError: ``num_hidden_layers`` or ``every`` not an int >= 1.
    """
    for name, v in (("num_hidden_layers", num_hidden_layers), ("every", every)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"k3_full_attn_layers: {name} must be an int >= 1, got {v!r}")
    return sorted(set(range(every, num_hidden_layers + 1, every)) | {num_hidden_layers})


@dataclass
class K3Config:
    """Shape and options of ``K3Model``; defaults are K3's (``k3-full``).

    Attributes (released names):
        vocab_size (int): 163840.
        hidden_size (int): d, 7168.
        num_hidden_layers (int): L, 93.
        full_attn_layers (list[int]): 1-based indices of the Gated MLA layers; every other layer is KDA.
        num_attention_heads (int): H of both KDA and MLA, 96.
        head_dim (int): KDA's d_k = d_v, 128.
        q_lora_rank (int | None): MLA's low-rank query width, 1536 (None: full-rank W_q).
        kv_lora_rank (int): MLA's key/value latent width, 512.
        qk_nope_head_dim (int), qk_rope_head_dim (int): MLA's per-head query/key channels, 128 + 64 (the 64
            meet the head-shared key part; unrotated, K3 uses NoPE).
        v_head_dim (int): MLA's value head width, 128.
        n_routed_experts (int): E, 896. num_experts_per_tok (int): K, 16. n_shared_experts (int): 2.
        moe_intermediate_size (int): each expert's hidden width, 3072.
        first_k_dense_replace (int): the first this-many layers have a dense FFN, 1.
        intermediate_size (int): the dense FFN's hidden width, 33792.
        moe_renormalize (bool): renormalise the selected router scores, True.
        routed_scaling_factor (float): 1.0.
        activation_situ_beta (float), activation_situ_linear_beta (float): SiTU-GLU's b1 = 4, b2 = 25.
        attn_res_block_size (int): layers per Block AttnRes block, 12.
        rms_norm_eps (float): 1e-6.
        tie_word_embeddings (bool): False.
        num_nextn_predict_layers (int): MTP depth D, 0 (the released config has none; K3's Table 1 lists
            one): D sequential multi-token-prediction modules (``k3lab.model.MTPModule``).

    Attributes (k3lab names):
        moe_latent_size (int | None): LatentMoE's routed width l, 3584 (None: a full-width MoE).
        moe_balance (str): "qb" (Quantile Balancing, K3), "sign", "aux" or "none". With "aux" the MoE layers compute
            their auxiliary loss, which K3Model's loss does not include: add ``k3lab.moe.balance_loss(model)`` to it.
        kda_gate_lower_bound (float): g_min of K3's lower-bounded KDA gate, -5.
        kda_gate_rank (int | None): rank of KDA's output gate, 128 (Kimi Linear's low-rank gate; see
            ``k3lab.model.count_params`` for why); None: full rank.
        kda_conv_size (int): KDA's short-convolution width, 4.
        kda_chunk_size (int): chunk C of the PyTorch chunkwise KDA, 64.
        init_std (float): std of the normal init of linear and embedding weights, 0.02 (> 0).
        mtp_loss_weight (float): lambda of the MTP loss, loss = main + lambda * mean over depths (0.3,
            DeepSeek-V3's weight for the first part of training).

    Raises:
        ValueError: a non-positive size, full_attn_layers not sorted distinct ints in [1, L],
            first_k_dense_replace outside [0, L], top-k > experts (or = experts with moe_balance "qb"),
            init_std or routed_scaling_factor not a finite number > 0, SiTU betas other than 4 and 25 (the
            ``k3lab.moe`` activation has them fixed), mtp_loss_weight not a finite number >= 0, an unknown balancer,
            qk_rope_head_dim or kv_lora_rank < 1, a bad KDA gate bound or chunk size.
    """

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    full_attn_layers: list[int] = field(default_factory=k3_full_attn_layers)
    num_attention_heads: int = 96
    head_dim: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 896
    num_experts_per_tok: int = 16
    n_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    attn_res_block_size: int = 12
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    moe_latent_size: int | None = 3584
    moe_balance: str = "qb"
    kda_gate_lower_bound: float = -5.0
    kda_gate_rank: int | None = 128
    kda_conv_size: int = 4
    kda_chunk_size: int = 64
    init_std: float = 0.02
    mtp_loss_weight: float = 0.3

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """ValueError naming the first field out of range (run at construction, and by ``K3Model`` again: a
        field set after construction is checked there too)."""
        optional = {"q_lora_rank", "moe_latent_size", "kda_gate_rank"}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", "int | None") and not (v is None and f.name in optional):
                if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                    raise ValueError(f"K3Config.{f.name} must be an int >= 0, got {v!r}")
                if v == 0 and f.name not in ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers"):
                    raise ValueError(f"K3Config.{f.name} must be positive, got 0")
        L = self.num_hidden_layers
        fa = self.full_attn_layers
        if not (isinstance(fa, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in fa)
                and list(fa) == sorted(set(fa)) and all(1 <= i <= L for i in fa)):
            raise ValueError(f"K3Config.full_attn_layers must be sorted distinct 1-based layer indices in [1, {L}], "
                             f"got {fa!r}")
        self.full_attn_layers = list(fa)
        if self.first_k_dense_replace > L:
            raise ValueError(f"K3Config.first_k_dense_replace must be in [0, num_hidden_layers={L}], "
                             f"got {self.first_k_dense_replace}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"K3Config.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"n_routed_experts={self.n_routed_experts}")
        # Checked here, not first by k3lab.moe.MoEConfig when the model is built.
        if self.moe_balance == "qb" and self.num_experts_per_tok == self.n_routed_experts:
            raise ValueError(f"K3Config.moe_balance='qb' needs num_experts_per_tok < n_routed_experts (Quantile "
                             f"Balancing reads each token's (K+1)-th score), got both {self.n_routed_experts}; "
                             f"use moe_balance='none'")
        # k3lab.moe's SiTU-GLU has b1 = 4, b2 = 25 built in: other values would be silently ignored.
        for name, v, fixed in (("activation_situ_beta", self.activation_situ_beta, BETA1),
                               ("activation_situ_linear_beta", self.activation_situ_linear_beta, BETA2)):
            if v != fixed:
                raise ValueError(f"K3Config.{name} must be {fixed} (k3lab.moe's SiTU-GLU fixes it), got {v!r}")
        w = self.mtp_loss_weight
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0):
            raise ValueError(f"K3Config.mtp_loss_weight must be a finite number >= 0, got {w!r}")
        if self.moe_balance not in BALANCERS:
            raise ValueError(f"K3Config.moe_balance must be one of {BALANCERS}, got {self.moe_balance!r}")
        for name in ("moe_renormalize", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"K3Config.{name} must be a bool, got {getattr(self, name)!r}")
        for name, positive in (("routed_scaling_factor", True), ("init_std", True), ("rms_norm_eps", True)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    and (v > 0 if positive else v >= 0)):
                raise ValueError(f"K3Config.{name} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")
        check_lower_bound(self.kda_gate_lower_bound)
        check_chunk_size(self.kda_chunk_size, name="K3Config.kda_chunk_size")
        if self.moe_latent_size and self.moe_latent_size > self.hidden_size:
            raise ValueError(f"K3Config.moe_latent_size {self.moe_latent_size} is wider than hidden_size "
                             f"{self.hidden_size}: the latent projection narrows the token (None: full width)")
        # The routed experts' grouped GEMMs need 16-byte rows (k3lab.moe.expert_ffn): 8 elements in bf16. Checked
        # here so the message names the config's fields, not the layer's d and h at the first forward.
        expert_width = ("moe_latent_size", self.moe_latent_size) if self.moe_latent_size else ("hidden_size",
                                                                                             self.hidden_size)
        for name, v in (expert_width, ("moe_intermediate_size", self.moe_intermediate_size)):
            if v % 8:
                raise ValueError(f"K3Config.{name} must be a multiple of 8 (the routed experts' grouped GEMMs need "
                                 f"16-byte rows in bf16), got {v}")

    @property
    def num_mla_layers(self) -> int:
        return len(self.full_attn_layers)

    @property
    def n_attn_res_blocks(self) -> int:
        """N = ceil(L / attn_res_block_size) Block AttnRes blocks (K3: 8)."""
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    def attn_res_sizes(self) -> list[int]:
        """Sublayers in each Block AttnRes block: 2 * attn_res_block_size (a mixer and an FFN per layer),
        the last block partial (K3: [24] * 7 + [18], 8 blocks of 12 layers with 9 in the last)."""
        size, total = 2 * self.attn_res_block_size, 2 * self.num_hidden_layers
        return [min(size, total - start) for start in range(0, total, size)]

    def layer_types(self) -> list[str]:
        """Each layer's token mixer, 0-based: "mla" for the 1-based ``full_attn_layers``, else "kda"."""
        mla = set(self.full_attn_layers)
        return ["mla" if i + 1 in mla else "kda" for i in range(self.num_hidden_layers)]

    def ffn_types(self) -> list[str]:
        """Each layer's FFN, 0-based: "dense" for the first ``first_k_dense_replace``, else "moe"."""
        return ["dense" if i < self.first_k_dense_replace else "moe" for i in range(self.num_hidden_layers)]

    @classmethod
    def preset(cls, name: str, **overrides) -> "K3Config":
        """A named preset ("k3-full", "k3-1b", "k3-tiny") with fields overridden.

        Raises:
            ValueError: an unknown name (the message lists the presets); an override that is not a field; bad
                overrides (as the constructor).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
        unknown = sorted(set(overrides) - {f.name for f in fields(K3Config)})
        if unknown:
            raise ValueError(f"K3Config has no field(s) {unknown} (overrides of preset {name!r})")
        return replace(PRESETS[name](), **overrides)


def _k3_1b() -> K3Config:
    # K3's ratios at d = 1024: 17 layers = 4 x (3 KDA + 1 MLA) + a final MLA, 8 heads x 128, MLA ranks
    # scaled by d / 7168 (rounded to multiples of 64, head widths kept), 64 experts top-8 (K3's
    # 1:56 sparsity would leave too few experts to learn on one GPU), expert hidden 384 and latent 512
    # (d / 2), dense hidden 4864 (4.7 d as K3's 33792 / 7168), AttnRes blocks of 4 layers (5 blocks).
    # The corpus tokenizer is smaller: pass vocab_size=k3lab.data.vocab_size() to train on it.
    return K3Config(hidden_size=1024, num_hidden_layers=17, full_attn_layers=k3_full_attn_layers(17),
                    num_attention_heads=8, head_dim=128, q_lora_rank=256, kv_lora_rank=128,
                    n_routed_experts=64, num_experts_per_tok=8, n_shared_experts=2, moe_intermediate_size=384,
                    moe_latent_size=512, intermediate_size=4864, attn_res_block_size=4)


def _k3_tiny() -> K3Config:
    # 5 layers = KDA, KDA, KDA, MLA, MLA (one 3:1 group and the final MLA); the first one dense;
    # AttnRes blocks of 2 layers (3 blocks); every width a multiple of 4 (float32 grouped GEMMs).
    return K3Config(vocab_size=256, hidden_size=64, num_hidden_layers=5, full_attn_layers=[4, 5],
                    num_attention_heads=2, head_dim=16, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                    n_shared_experts=1, moe_intermediate_size=32, moe_latent_size=32, intermediate_size=128,
                    attn_res_block_size=2, kda_gate_rank=8, kda_chunk_size=16)


PRESETS = {"k3-full": K3Config, "k3-1b": _k3_1b, "k3-tiny": _k3_tiny}
