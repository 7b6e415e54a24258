"""The MoE transformer (one device, no networking)."""

from swarm.model.expert_gemm import BackendUnavailable, check_backend
from swarm.model.transformer import ModelOutput, MoETransformer

__all__ = ["BackendUnavailable", "ModelOutput", "MoETransformer", "check_backend"]
