from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "layers", "logical_experts", "physical_experts", "top_k")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    name: str
    layers: int
    logical_experts: int
    physical_experts: int
    top_k: int
    def __init__(self, name: _Optional[str] = ..., layers: _Optional[int] = ..., logical_experts: _Optional[int] = ..., physical_experts: _Optional[int] = ..., top_k: _Optional[int] = ...) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("engine_id", "data_parallel_size", "dp_ranks", "models", "current_step", "incarnation")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_RANKS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    data_parallel_size: int
    dp_ranks: _containers.RepeatedScalarFieldContainer[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    current_step: int
    incarnation: str
    def __init__(self, engine_id: _Optional[str] = ..., data_parallel_size: _Optional[int] = ..., dp_ranks: _Optional[_Iterable[int]] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., current_step: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class StreamLoadRequest(_message.Message):
    __slots__ = ("dp_ranks", "steps_per_report")
    DP_RANKS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_REPORT_FIELD_NUMBER: _ClassVar[int]
    dp_ranks: _containers.RepeatedScalarFieldContainer[int]
    steps_per_report: int
    def __init__(self, dp_ranks: _Optional[_Iterable[int]] = ..., steps_per_report: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("dp_rank", "model", "first_step", "num_steps", "layers", "slots", "counts", "incarnation", "placement_version")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    model: str
    first_step: int
    num_steps: int
    layers: int
    slots: int
    counts: bytes
    incarnation: str
    placement_version: int
    def __init__(self, dp_rank: _Optional[int] = ..., model: _Optional[str] = ..., first_step: _Optional[int] = ..., num_steps: _Optional[int] = ..., layers: _Optional[int] = ..., slots: _Optional[int] = ..., counts: _Optional[bytes] = ..., incarnation: _Optional[str] = ..., placement_version: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("model", "layers", "physical_experts", "phy2log", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    layers: int
    physical_experts: int
    phy2log: bytes
    version: int
    def __init__(self, model: _Optional[str] = ..., layers: _Optional[int] = ..., physical_experts: _Optional[int] = ..., phy2log: _Optional[bytes] = ..., version: _Optional[int] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("switch_id", "placements", "apply_at_step", "dp_ranks")
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    APPLY_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    DP_RANKS_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    apply_at_step: int
    dp_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, switch_id: _Optional[str] = ..., placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., apply_at_step: _Optional[int] = ..., dp_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("ok", "error", "staging_seconds", "experts_to_copy", "current_step")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STAGING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    staging_seconds: float
    experts_to_copy: int
    current_step: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., staging_seconds: _Optional[float] = ..., experts_to_copy: _Optional[int] = ..., current_step: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("switch_id", "dp_ranks", "apply_at_step")
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANKS_FIELD_NUMBER: _ClassVar[int]
    APPLY_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    dp_ranks: _containers.RepeatedScalarFieldContainer[int]
    apply_at_step: int
    def __init__(self, switch_id: _Optional[str] = ..., dp_ranks: _Optional[_Iterable[int]] = ..., apply_at_step: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("ok", "error", "apply_at_step")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    APPLY_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    apply_at_step: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., apply_at_step: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("switch_id", "reason")
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    reason: str
    def __init__(self, switch_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PendingSwitch(_message.Message):
    __slots__ = ("model", "switch_id", "committed", "apply_at_step")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    APPLY_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    model: str
    switch_id: str
    committed: bool
    apply_at_step: int
    def __init__(self, model: _Optional[str] = ..., switch_id: _Optional[str] = ..., committed: _Optional[bool] = ..., apply_at_step: _Optional[int] = ...) -> None: ...

class PlacementState(_message.Message):
    __slots__ = ("placements", "current_step", "pending")
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    current_step: int
    pending: _containers.RepeatedCompositeFieldContainer[PendingSwitch]
    def __init__(self, placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., current_step: _Optional[int] = ..., pending: _Optional[_Iterable[_Union[PendingSwitch, _Mapping]]] = ...) -> None: ...
