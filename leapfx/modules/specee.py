"""SpecEE's exit predictors (sec. 4.3, Fig. 6): the modules ``InsertExitPredictors`` inserts.

SpecEE decides per token whether it may leave the model after layer ``l``. The decision looks at
k = 4 speculative tokens S (the drafter's top-4 for the next position) instead of the whole
vocabulary: the features of layer ``l`` (sec. 4.3.1, our notation, ``N`` the final norm, ``W``
the LM head) are

    z_l = N(h_l) . W[S]^T          # [k], the ``leapfx::subset_logits`` op: no [V, H] product
    p_l = softmax(z_l)             # [k], a distribution over S only
    D_l = p_l - p_{l-1}            # [k]; D = p_l at the first predicted layer
    x_l = cat([z_l, p_l, D_l])     # [12], no further normalisation (the authors' code)

and a two-layer MLP per layer (Linear 12->512, ReLU, Linear 512->1, Sigmoid) gives the exit
probability. One MLP for each layer 0..L-2 (the last layer needs none): L - 1 of them, owned by a
:class:`SpecEEPredictors` module that the rewritten GraphModule holds (``gm.specee``), never by
the user's model. ``D`` always means "from the previous layer": the runtime computes ``z`` at
``l - 1`` too when it checks ``l`` (spec sec. 9.1, cheaper than computing it at every layer).

``leapfx.passes.predictor`` inserts the nodes that call them (and says where they sit in the
graph); ``KernelLayerExit`` is the check on one ``leapfx_cpu::exit_check`` call, which the
CPU-kernel lowering puts in the check stages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_specee
from ..kernels._triton import implementation
from ..kernels.cpu_specee import exit_check, pack_mlp
from ..kernels.subset import subset_logits, subset_logits_reference

NUM_SPECULATIVE_TOKENS = 4  # k (sec. 4.3.1: "generate 4 speculative tokens each time")
HIDDEN_WIDTH = 512  # Fig. 8: 2 layers of width 512 are best
NUM_FEATURES = 3 * NUM_SPECULATIVE_TOKENS


class ExitMLP(nn.Sequential):
    """Linear(12 -> 512), ReLU, Linear(512 -> 1), Sigmoid: one layer's exit predictor."""

    def __init__(self, width: int = HIDDEN_WIDTH, num_features: int = NUM_FEATURES) -> None:
        super().__init__(
            nn.Linear(num_features, width), nn.ReLU(), nn.Linear(width, 1), nn.Sigmoid()
        )


def exit_features(
    normed: torch.Tensor,
    head_weight: torch.Tensor,
    candidates: torch.Tensor,
    p_prev: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 features of sec. 4.3.1 and p_l: ``([R, 3k], [R, k])`` for ``normed`` [R, H].

    ``normed`` is N(h_l) (the final norm already applied); ``candidates`` [k] are S;
    ``p_prev`` [R, k] is p_{l-1} (None at the first predicted layer: D = p_l).

    >>> x, p = exit_features(torch.ones(1, 2), torch.eye(2), torch.tensor([0, 1]), None)
    >>> x.tolist(), p.tolist()
    ([[1.0, 0.0, 0.7310585975646973, 0.2689414322376251, 0.7310585975646973, 0.2689414322376251]], [[0.7310585975646973, 0.2689414322376251]])
    """  # noqa: E501
    if torch.compiler.is_compiling() or implementation(normed) == "triton":
        z, p = subset_logits(normed, head_weight, candidates)  # [R, k] each, float32
    else:
        # Eager without Triton: the op's own torch reference, called directly. The custom-op
        # dispatch (and the dynamo guard it runs under) costs several times the arithmetic of
        # k = 4 rows, and the check sits on every active layer of the decode's critical path.
        z, p = subset_logits_reference(normed, head_weight, candidates)
    d = p if p_prev is None else p - p_prev
    return torch.cat([z, p, d], dim=-1), p


class LayerExit(nn.Module):
    """The exit-check node of one layer: features of the last position, then its MLP.

    Holds the host's final norm and LM head by plain reference (not as submodules), so the
    predictors' state dict holds only the MLP.
    """

    def __init__(self, layer: int, mlp: ExitMLP, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.mlp = mlp
        self._host = (norm, head)  # a tuple: not registered, not saved, not moved

    def forward(
        self,
        hidden: torch.Tensor,
        candidates: torch.Tensor,
        p_prev: torch.Tensor | None,
        with_mlp: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``hidden`` [B, S, H] (h_l) -> (exit probability [B], p_l [B, k]).

        ``with_mlp=False`` computes p_l only (the layer below an active one: D needs it)."""
        prob, p, _ = self._exit(hidden, candidates, p_prev, with_mlp)
        return prob, p

    def _exit(
        self, hidden: torch.Tensor, candidates: torch.Tensor, p_prev: torch.Tensor | None,
        with_mlp: bool, threshold: float | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """What ``forward`` and ``check`` compute: ``(probability [B] or None without the MLP,
        p_l [B, k], logits or None)``; the torch path leaves the logits to the head stage
        (``threshold``: where a kernel returns them)."""
        norm, head = self._host
        # .forward and F.linear: the same math without nn.Module dispatch, which costs more
        # than the arithmetic at this size (the check runs on the decode's critical path).
        normed = norm.forward(hidden[:, -1])  # [B, H]
        x, p = exit_features(normed, head.weight, candidates, p_prev)
        if not with_mlp:
            return None, p, None
        first, last = self.mlp[0], self.mlp[2]
        a = torch.relu(F.linear(x.to(first.weight.dtype), first.weight, first.bias))  # [B, 512]
        return torch.sigmoid(F.linear(a, last.weight, last.bias))[:, 0], p, None  # [B], [B, k]

    def check(
        self,
        hidden: torch.Tensor,
        candidates: torch.Tensor,
        p_prev: torch.Tensor | None,
        threshold: float,
    ) -> tuple[float, torch.Tensor, torch.Tensor | None]:
        """The runtime's exit check of one row (B = 1): ``(probability, p_l [1, k], logits)``.

        The probability is a Python float (the decision's host sync). ``logits`` [1, V] are
        N(h_l) W^T where the check computed them on the way (it fired: the global check needs
        them), None where the caller computes them (here always: the torch path leaves them to
        the head stage).
        """
        prob, p, logits = self._exit(hidden, candidates, p_prev, True, threshold)
        return float(prob), p, logits


class KernelLayerExit(LayerExit):
    """A LayerExit whose check is one ``leapfx_cpu::exit_check`` call (CPU, float32).

    What ``kernel_stages`` (``SpeculativeModel.use_cpu_kernels``) puts in the check stages:
    the same numbers as :class:`LayerExit` up to summation order, in one dispatch instead of
    ~15 (see ``leapfx.kernels.cpu_specee``). It shares the MLP, the final norm and the LM
    head with the LayerExit it wraps; the MLP's packed copy is remade whenever a weight of the
    MLP changed in place (training), so it is never stale. Where the op does not apply (the
    norm is not an RMSNorm it reproduces, a dtype other than float32, under torch.compile, or
    gradients are wanted) it runs the torch path of LayerExit.
    """

    def __init__(self, source: LayerExit) -> None:
        super().__init__(source.layer, source.mlp, *source._host)
        norm, head = source._host
        weight = head.weight
        usable = (
            cpu_specee.available()
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and weight.is_contiguous()
            and all(p.dtype == torch.float32 for p in source.mlp.parameters())
        )
        offset = cpu_specee.rms_offset(norm, weight) if usable else None
        eps = cpu_specee.norm_epsilon(norm)
        self._norm = None if offset is None else (norm.weight, eps, offset)
        first, last = source.mlp[0], source.mlp[2]
        self._params = (first.weight, first.bias, last.weight, last.bias)  # not registered
        self._head_weight = weight
        self._packed: tuple[tuple[int, ...], torch.Tensor] | None = None

    def _mlp_packed(self) -> torch.Tensor:
        w1, b1, w2, b2 = self._params
        versions = (w1._version, b1._version, w2._version, b2._version)
        if self._packed is None or self._packed[0] != versions:
            self._packed = (versions, pack_mlp(*self._params))
        return self._packed[1]

    def _torch_path(self, hidden: torch.Tensor) -> bool:
        return (
            self._norm is None
            or hidden.dtype != torch.float32
            or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and hidden.requires_grad)
        )

    def _exit(self, hidden, candidates, p_prev, with_mlp, threshold=None):
        """LayerExit's forward and check in one call, the full logits included where the check
        fires (``threshold``)."""
        if self._torch_path(hidden):
            return super()._exit(hidden, candidates, p_prev, with_mlp)
        mlp = self._mlp_packed() if with_mlp else hidden
        fires = {} if threshold is None else {"threshold": threshold}
        prob, p, logits = exit_check(
            hidden, self._norm, self._head_weight, candidates, p_prev, mlp, with_mlp, **fires
        )
        return (prob if with_mlp else None), p, logits


class SpecEEPredictors(nn.Module):
    """The L - 1 exit MLPs and the offline layer subset of the two-level schedule (sec. 5).

    ``offline`` [L - 1] (a bool buffer) marks the layers the offline level keeps; it is measured
    when the predictors are trained and saved with them (all False before: the online window
    alone decides).
    """

    def __init__(self, num_layers: int, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.num_layers = num_layers
        self.exits = nn.ModuleList(
            LayerExit(i, ExitMLP(), norm, head) for i in range(num_layers - 1)
        )
        self.register_buffer("offline", torch.zeros(num_layers - 1, dtype=torch.bool))

    def offline_layers(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.offline.nonzero().flatten().tolist())
