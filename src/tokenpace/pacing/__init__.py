"""Pure pacing policy: the per-user rate table and the GCRA output-token limiter.

Nothing here imports vLLM or a web stack; the clock is injected so that tests and
simulations can drive time exactly.
"""

from ._drafts import BULK_MAX_STEPS, DraftBook
from ._inner import InnerRates, inner_levels
from ._lanes import DEFAULT_MIN_SHARE, LanePolicy
from ._limiter import BURST_NS, OutputRateLimiter
from ._planner import (
    MAY_SAMPLE,
    MAX_IDLE_WAIT_S,
    NO_SAMPLE,
    SAMPLES,
    RunningPlan,
    Settlement,
    StepPlanner,
    Stream,
)
from ._ranks import user_rank
from ._stats import (
    DEFAULT_MAX_USERS,
    MAX_LANES,
    OTHER_LANE,
    OTHER_USER,
    LaneStats,
    PacingStats,
    StatsSnapshot,
    UserStats,
)
from ._reload import RELOAD_CHECK_NS, LimitsFileWatcher, ReloadResult
from ._limits import (
    MAX_USER_ID_LENGTH,
    LimitsError,
    UserRateLimits,
    limits_file_of,
    parse_overrides_arg,
    parse_overrides_json,
    read_overrides_file,
    validate_overrides,
    validate_rate,
    validate_rate_version,
    validate_user_id,
)

__all__ = [
    "BURST_NS",
    "DEFAULT_MAX_USERS",
    "DEFAULT_MIN_SHARE",
    "LanePolicy",
    "LaneStats",
    "MAX_LANES",
    "OTHER_LANE",
    "BULK_MAX_STEPS",
    "DraftBook",
    "InnerRates",
    "inner_levels",
    "OTHER_USER",
    "PacingStats",
    "StatsSnapshot",
    "UserStats",
    "MAX_IDLE_WAIT_S",
    "MAY_SAMPLE",
    "NO_SAMPLE",
    "SAMPLES",
    "LimitsFileWatcher",
    "RELOAD_CHECK_NS",
    "ReloadResult",
    "RunningPlan",
    "Settlement",
    "StepPlanner",
    "Stream",
    "MAX_USER_ID_LENGTH",
    "LimitsError",
    "OutputRateLimiter",
    "UserRateLimits",
    "limits_file_of",
    "parse_overrides_arg",
    "parse_overrides_json",
    "read_overrides_file",
    "validate_overrides",
    "validate_rate",
    "validate_rate_version",
    "validate_user_id",
    "user_rank",
]
