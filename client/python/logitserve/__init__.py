"""logitserve: Python client for the logitserve logit-scoring service.

    import numpy as np, logitserve
    client = logitserve.Client("127.0.0.1:50051")
    r = client.score(head="policy", hidden=h, target_ids=ids, reference_head="reference",
                     reference_hidden=h_ref, entropy=True, forward_kl=True)
    r.target_logprobs, r.entropy, r.forward_kl   # numpy arrays, nats; model = p, reference = q

Every output is in nats. forward_kl = KL(q || p), reverse_kl = KL(p || q); jsd = JSD_beta with
m = (1-beta) p + beta q (beta = 0 -> forward_kl, beta = 1 -> reverse_kl); p = softmax(z / T).
"""

from ._aio import AsyncClient
from ._api import HeadInfo, Request, ScoreResult, SequenceStats, ServerHeads
from ._client import Client, TlsConfig
from ._shm import SharedMemoryRegion, SharedTensor
from ._errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                      FailedPrecondition, Internal, InvalidArgument, LogitserveError, NotFound,
                      OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated,
                      Unavailable, Unimplemented, Unknown)
from ._tensors import bf16_bits_to_f32, to_bf16_bits

__version__ = "0.1.0"

__all__ = [
    "Client", "AsyncClient", "TlsConfig", "SharedMemoryRegion", "SharedTensor", "Request", "ScoreResult", "SequenceStats", "HeadInfo",
    "ServerHeads", "LogitserveError", "Cancelled", "Unknown", "InvalidArgument",
    "DeadlineExceeded", "NotFound", "AlreadyExists", "PermissionDenied", "ResourceExhausted",
    "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented", "Internal", "Unavailable",
    "DataLoss", "Unauthenticated", "to_bf16_bits", "bf16_bits_to_f32",
]
