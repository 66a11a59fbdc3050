"""CSWin Transformer (Dong et al., CVPR 2022, "CSWin Transformer: A General Vision
Transformer Backbone with Cross-Shaped Windows"), written here because timm has none.

Per stage s with resolution R_s and stripe width sw_s:

* cross-shaped window self-attention: the heads are split in two halves; the first half
  attends within vertical stripes (R_s × sw_s), the second within horizontal stripes
  (sw_s × R_s); the last stage attends globally with all heads;
* LePE (locally-enhanced positional encoding): out = softmax(QKᵀ/√d)V + DWConv3×3(V),
  the depthwise conv applied to V inside each stripe;
* pre-norm blocks x ← x + DropPath(Attn(LN(x))), x ← x + DropPath(MLP(LN(x)));
* a convolutional stem (7×7 stride 4 in the paper; kernel 2p−1, stride p, padding p−1 for
  patch size p here, so small images work) and 3×3 stride-2 convolutions merging stages.

Stripe widths must divide each stage's resolution; a clear error says otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp
from torch import nn

from ..nn.precision import autocast_dtype


def to_stripes(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, H, W, C) → (B · H/height · W/width, height · width, C)."""
    b, h, w, c = x.shape
    x = x.view(b, h // height, height, w // width, width, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, height * width, c)


def from_stripes(x: torch.Tensor, height: int, width: int, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`to_stripes`: (B · nW, height · width, C) → (B, H, W, C)."""
    c = x.shape[-1]
    x = x.view(-1, h // height, w // width, height, width, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, h, w, c)


class LePEConv(nn.Conv2d):
    """LePE's depthwise 3×3 convolution (stride 1, padding 1), an ``nn.Conv2d`` with its parameters.

    Eager, it is one ``F.conv2d``. Compiled, it is the same cross-correlation written as nine shifted products,
    out[c, y, x] = b[c] + Σᵢⱼ w[c, 0, i, j] · x̃[c, y + i, x + j] (x̃ zero-padded by one), which the compiler fuses
    into one kernel: torch's choice of a depthwise-convolution backend reads the batch size, so a compiled
    ``F.conv2d`` here compiled the network again for batch sizes in another range (an epoch's last batch, a
    measurement's).
    """

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, 3, padding=1, groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return super().forward(x)
        return depthwise_conv3x3_taps(x, self.weight, self.bias)


def depthwise_conv3x3_taps(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, padding=1, groups=C)`` for (N, C, H, W) x and (C, 1, 3, 3) weight, as nine
    shifted elementwise products (no convolution backend to choose). Under autocast all three take its dtype, as the
    convolution's do; otherwise none is cast (a float64 weight is never rounded to a lower input's dtype)."""
    if (dtype := autocast_dtype(x.device.type)) is not None:
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    h, w = x.shape[-2:]
    padded = F.pad(x, (1, 1, 1, 1))
    out = sum(weight[:, 0, i, j, None, None] * padded[..., i:i + h, j:j + w] for i in range(3) for j in range(3))
    return out if bias is None else out + bias[:, None, None]


class CrossShapedAttention(nn.Module):
    """Cross-shaped window attention with LePE on a (B, H, W, C) feature map.

    ``stripe_width=None`` makes it global (one branch, all heads), as in the last stage.
    Follows the attention convention of :mod:`stability.models.view`.
    """

    def __init__(self, dim: int, num_heads: int, resolution: int, stripe_width: int | None,
                 qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.resolution = resolution
        self.fused_attn = True
        self.kernel: nn.Module | None = None
        self.branch_divisor = 1.0  # each branch's output (attention + LePE) is divided by it
        if stripe_width is None or stripe_width >= resolution:
            self.stripes = [(resolution, resolution)]  # global attention
        else:
            if num_heads % 2:
                raise ValueError(
                    f"cross-shaped attention splits heads between vertical and horizontal stripes, "
                    f"so num_heads must be even; got {num_heads}")
            if resolution % stripe_width:
                raise ValueError(
                    f"stripe width {stripe_width} does not divide the stage resolution {resolution}; "
                    f"choose a divisor of {resolution}: {divisors(resolution)}")
            self.stripes = [(resolution, stripe_width), (stripe_width, resolution)]
        branch_dim = dim // len(self.stripes)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.lepe = nn.ModuleList(LePEConv(branch_dim) for _ in self.stripes)
        self.softmax = nn.Softmax(dim=-1)  # a module, so that its input (the logits) can be observed
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        if h != self.resolution or w != self.resolution:
            raise ValueError(f"expected a {self.resolution}×{self.resolution} feature map, got {h}×{w}")
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (B, H, W, C)
        width = c // len(self.stripes)
        heads = self.num_heads // len(self.stripes)
        outs = []
        for i, (sh, sw) in enumerate(self.stripes):
            part = slice(i * width, (i + 1) * width)
            outs.append(self._branch(q[..., part], k[..., part], v[..., part], sh, sw, heads, self.lepe[i]))
        out = torch.cat(outs, dim=-1)
        return self.proj_drop(self.proj(out))

    def _branch(self, q, k, v, sh, sw, heads, lepe):
        h, w = q.shape[1:3]
        q, k, v = (to_stripes(t, sh, sw) for t in (q, k, v))  # (B·nW, N, C')
        n, cb = q.shape[1:]
        pos = lepe(v.transpose(1, 2).reshape(-1, cb, sh, sw)).flatten(2).transpose(1, 2)  # (B·nW, N, C')
        q, k, v = (t.view(-1, n, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B·nW, h, N, d)
        if self.kernel is not None:  # a replacement attention kernel, e.g. LipsFormer's cosine attention
            out = self.kernel(q, k, v, None, self.attn_drop, self.fused_attn)
        elif self.fused_attn:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            attn = self.attn_drop(self.softmax(attn))  # (B·nW, h, N, N)
            out = attn @ v
        out = (out.transpose(1, 2).reshape(-1, n, cb) + pos) / self.branch_divisor
        return from_stripes(out, sh, sw, h, w)


class CSWinBlock(nn.Module):
    """Pre-norm transformer block with cross-shaped attention; tokens as (B, H, W, C)."""

    def __init__(self, dim: int, num_heads: int, resolution: int, stripe_width: int | None,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True, drop_path: float = 0.0,
                 attn_drop: float = 0.0, proj_drop: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CrossShapedAttention(dim, num_heads, resolution, stripe_width, qkv_bias, attn_drop, proj_drop)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class ConvEmbed(nn.Module):
    """Convolution + LayerNorm, (B, C, H, W) or (B, H, W, C) in, (B, H', W', C') out.

    Used as the stem (kernel 2p−1, stride p) and as the merge between stages (3×3, stride 2).
    """

    def __init__(self, in_chans: int, dim: int, kernel: int, stride: int, padding: int,
                 channels_last_input: bool) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel, stride, padding)
        self.norm = nn.LayerNorm(dim)
        self.channels_last_input = channels_last_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last_input:
            x = x.permute(0, 3, 1, 2)
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


class CSWinTransformer(nn.Module):
    """CSWin classifier: conv stem, stages of CSWin blocks joined by conv merges, LN, mean pool, head.

    Args:
        img_size: input height = width.
        patch_size: stride of the stem; img_size / patch_size is the first stage's resolution.
        embed_dim: channels of the first stage (doubled at each merge).
        depths, num_heads, stripe_widths: one entry per stage. The last stage is global and
            ignores its stripe width.
    """

    def __init__(self, img_size: int = 224, patch_size: int = 4, in_chans: int = 3, num_classes: int = 1000,
                 embed_dim: int = 64, depths: Sequence[int] = (1, 2, 21, 1),
                 num_heads: Sequence[int] = (2, 4, 8, 16), stripe_widths: Sequence[int] = (1, 2, 7, 7),
                 mlp_ratio: float = 4.0, qkv_bias: bool = True, drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, drop_path_rate: float = 0.1) -> None:
        super().__init__()
        stages = len(depths)
        if not (len(num_heads) == len(stripe_widths) == stages):
            raise ValueError(f"depths, num_heads and stripe_widths need one entry per stage; got "
                             f"{len(depths)}, {len(num_heads)}, {len(stripe_widths)}")
        if img_size % patch_size:
            raise ValueError(f"patch_size {patch_size} does not divide img_size {img_size}")
        resolution = img_size // patch_size
        if resolution % 2 ** (stages - 1):
            raise ValueError(f"{stages} stages halve the resolution {stages - 1} times, so img_size/patch_size "
                             f"= {resolution} must be divisible by {2 ** (stages - 1)}")
        self.num_classes = num_classes
        self.patch_embed = ConvEmbed(in_chans, embed_dim, 2 * patch_size - 1, patch_size, patch_size - 1,
                                     channels_last_input=False)
        rates = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        self.stages = nn.ModuleList()
        self.merges = nn.ModuleList()
        dim = embed_dim
        for s in range(stages):
            if s > 0:
                self.merges.append(ConvEmbed(dim, 2 * dim, 3, 2, 1, channels_last_input=True))
                dim, resolution = 2 * dim, resolution // 2
            last = s == stages - 1
            start = sum(depths[:s])
            self.stages.append(nn.Sequential(*(
                CSWinBlock(dim, num_heads[s], resolution, None if last else stripe_widths[s], mlp_ratio,
                           qkv_bias, rates[start + i], attn_drop_rate, drop_rate)
                for i in range(depths[s]))))
        self.num_features = dim
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.apply(_init_weights)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)  # (B, H, W, C)
        for s, stage in enumerate(self.stages):
            if s > 0:
                x = self.merges[s - 1](x)
            x = stage(x)
        return self.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x).mean(dim=(1, 2)))


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
