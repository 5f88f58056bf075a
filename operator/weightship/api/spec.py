"""ModelRollout.spec: what the user wants rolled out and how.

Field names follow Argo Rollouts where a concept exists there (steps, setWeight, pause,
analysis, failureLimit, abortScaleDownDelaySeconds...), so its users feel at home.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)

from weightship.api.base import (
    DNS_LABEL_PATTERN,
    DURATION_PATTERN,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    MAX_LABEL_VALUE,
    MAX_NAME,
    MAX_SHORT_TEXT,
    SHA256_DIGEST_PATTERN,
    URL_PATTERN,
    ApiModel,
    cel,
    matches,
    validations,
)
from weightship.api.durations import parse_duration
from weightship.api.podspec import POD_SPEC_SCHEMA, check_pod_spec
from weightship.api.promql import placeholders
from weightship.api.regex import RE2_VALID_RULE, check_re2
from weightship.kube.quantity import QUANTITY_PATTERN, quantity_value

MiB = 1024 * 1024
MAX_STEPS = 64
MAX_METRICS = 32
MAX_GOLDEN_PROMPTS = 64
S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$"
REVISION_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
NOTIFICATION_EVENTS = ("Promoted", "RolledBack", "Paused", "Failed", "StepCompleted")
NotificationEvent = Literal["Promoted", "RolledBack", "Paused", "Failed", "StepCompleted"]
DEFAULT_SLACK_EVENTS: tuple[NotificationEvent, ...] = ("Promoted", "RolledBack", "Failed")
QUERY_VARIABLES = (
    "namespace",
    "rollout",
    "canaryRevision",
    "canaryHash",
    "stableRevision",
    "stableHash",
    "interval",
)


# A quantity string longer than this means nothing here (no cap has 64 digits); the bound
# also keeps the CEL rule's cost estimate small.
MAX_QUANTITY_LENGTH = 64
_QUANTITY_MESSAGE = (
    "must be a quantity of at least 1 (such as 100Mi): 0, negative and milli values "
    "mean nothing here"
)


def _check_quantity(value: int | str) -> int | str:
    """At least 1 (a byte per second): "-1", "0" or "1m" would read as "no limit"."""
    if isinstance(value, str) and len(value) > MAX_QUANTITY_LENGTH:
        raise ValueError(f"may not be longer than {MAX_QUANTITY_LENGTH} characters")
    amount = quantity_value(value)
    if amount < 1:
        raise ValueError(_QUANTITY_MESSAGE)
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "maxLength": MAX_QUANTITY_LENGTH,
            "x-kubernetes-int-or-string": True,
            **validations(
                cel(
                    "type(self) == int ? self >= 1 : "
                    "quantity(string(self)).compareTo(quantity('1')) >= 0",
                    _QUANTITY_MESSAGE,
                )
            ),
        }
    ),
]

StringMap = Annotated[
    dict[str, Annotated[str, Field(max_length=MAX_SHORT_TEXT)]],
    Field(json_schema_extra={"maxProperties": 64}),
]

# Label keys and values as Kubernetes checks them (api.base's patterns). The API server
# refused such keys only when the ReplicaSet was made.
_LABEL_KEY_MESSAGE = (
    "keys must be qualified names (an optional DNS prefix and '/', then at most 63 "
    "alphanumeric, '-', '_' or '.' characters, alphanumeric at both ends)"
)
_LABEL_VALUE_MESSAGE = (
    "label values must be at most 63 alphanumeric, '-', '_' or '.' characters, "
    "alphanumeric at both ends"
)


def _check_keys(value: dict[str, str], *, values_too: bool) -> dict[str, str]:
    for key, item in value.items():
        prefix = key.split("/")[0] if "/" in key else ""
        if len(prefix) > MAX_NAME or not matches(LABEL_KEY_PATTERN, key):
            raise ValueError(f"{key[:80]!r}: {_LABEL_KEY_MESSAGE}")
        if values_too and not matches(LABEL_VALUE_PATTERN, item):
            raise ValueError(f"{key[:80]}={item[:80]!r}: {_LABEL_VALUE_MESSAGE}")
    return value


def _key_rules(*, values_too: bool) -> dict[str, Any]:
    key_rule = f"self.all(k, k.matches(r'{LABEL_KEY_PATTERN}') && k.indexOf('/') <= {MAX_NAME})"
    rules = [cel(key_rule, _LABEL_KEY_MESSAGE)]
    if values_too:
        rules.append(
            cel(f"self.all(k, self[k].matches(r'{LABEL_VALUE_PATTERN}'))", _LABEL_VALUE_MESSAGE)
        )
    return {"maxProperties": 64, **validations(*rules)}


LabelMap = Annotated[
    dict[str, Annotated[str, Field(max_length=MAX_LABEL_VALUE)]],
    AfterValidator(lambda v: _check_keys(v, values_too=True)),
    Field(json_schema_extra=_key_rules(values_too=True)),
]
AnnotationMap = Annotated[
    dict[str, Annotated[str, Field(max_length=MAX_SHORT_TEXT)]],
    AfterValidator(lambda v: _check_keys(v, values_too=False)),
    Field(json_schema_extra=_key_rules(values_too=False)),
]

# Durations the core's datetime arithmetic survives (a timedelta tops out near 2.7
# million years; 70,000,000 h admitted before raised OverflowError in every reconcile).
MAX_PAUSE = "8760h"  # a year
MIN_INTERVAL, MAX_INTERVAL = "1s", "24h"


def _duration_within(low: str | None, high: str) -> AfterValidator:
    def check(value: str | None) -> str | None:
        if value is None:
            return value
        try:
            amount = parse_duration(value)
        except OverflowError:
            amount = None
        if (
            amount is None
            or amount > parse_duration(high)
            or (low is not None and amount < parse_duration(low))
        ):
            raise ValueError(f"{value[:64]!r} must be between {low or '0s'} and {high}")
        return value

    return AfterValidator(check)


def _duration_rule(low: str | None, high: str) -> dict[str, Any]:
    rule = f"duration(self) <= duration('{high}')"
    if low is not None:
        rule = f"duration(self) >= duration('{low}') && {rule}"
    return validations(cel(rule, f"must be a duration between {low or '0s'} and {high}"))


def _exactly_one(model: ApiModel, fields: tuple[str, ...], message: str) -> None:
    if sum(getattr(model, name) is not None for name in fields) != 1:
        raise ValueError(message)


# --- workload ---------------------------------------------------------------------------


class LabelSelector(ApiModel):
    """Selects the inference pods this rollout owns (a subset of a Kubernetes LabelSelector)."""

    match_labels: LabelMap = Field(
        description="Labels every pod of this rollout carries. Must match "
        "spec.template.metadata.labels.",
        min_length=1,
    )


class PodTemplateMetadata(ApiModel):
    """Labels and annotations for the inference pods."""

    labels: LabelMap = Field(default_factory=dict, description="Labels of each pod.")
    annotations: AnnotationMap = Field(default_factory=dict, description="Annotations of each pod.")


class PodTemplate(ApiModel):
    """A core/v1 PodTemplateSpec for the inference pods. The operator adds the weights
    environment, the readiness gate `weightship.io/weights-verified` and the staged-node
    affinity; everything else is passed through unchanged."""

    metadata: PodTemplateMetadata = Field(
        default_factory=PodTemplateMetadata, description="Pod metadata (labels, annotations)."
    )
    spec: Annotated[
        dict[str, Any], AfterValidator(check_pod_spec), WithJsonSchema(POD_SPEC_SCHEMA)
    ] = Field(description=POD_SPEC_SCHEMA["description"])


class WorkloadRef(ApiModel):
    """An existing Deployment whose pod template the rollout runs instead of spec.template.
    Once the rollout's stable ReplicaSet has all spec.replicas (at least one) available, the
    operator records the Deployment's replica count in status.workload and scales it to
    zero; deleting the rollout, or pointing it elsewhere, scales it back to that count."""

    api_version: Literal["apps/v1"] = Field("apps/v1", description="API version of the workload.")
    kind: Literal["Deployment"] = Field("Deployment", description="Kind of the workload.")
    name: str = Field(
        description="Name of the Deployment, in the rollout's namespace.",
        min_length=1,
        max_length=MAX_NAME,
    )


# --- model ------------------------------------------------------------------------------


class SecretRef(ApiModel):
    """A Secret in the rollout's namespace."""

    name: str = Field(description="Name of the Secret.", min_length=1, max_length=MAX_NAME)


class SecretKeyRef(ApiModel):
    """A key of a Secret in the rollout's namespace."""

    name: str = Field(description="Name of the Secret.", min_length=1, max_length=MAX_NAME)
    key: str = Field("url", description="Key in the Secret's data.", max_length=MAX_NAME)


class ModelSource(ApiModel):
    """Where the weights and their manifest live."""

    uri: str = Field(
        description="S3 prefix of the weights, s3://<bucket>/<prefix>/. The manifest written by "
        "`weightship manifest` must sit beside the weights.",
        max_length=MAX_SHORT_TEXT,
        json_schema_extra=validations(
            cel(
                f"self.matches('{S3_URI_PATTERN}')",
                "spec.model.source.uri must start with s3:// and name a bucket "
                "(s3://<bucket>/<prefix>/)",
            )
        ),
    )
    endpoint: str | None = Field(
        None,
        description="S3 endpoint URL for S3-compatible stores (MinIO, versitygw). "
        "Empty means AWS S3.",
        max_length=MAX_SHORT_TEXT,
        pattern=URL_PATTERN,
    )
    region: str | None = Field(None, description="S3 region, e.g. us-east-1.", max_length=64)
    credentials_secret_ref: SecretRef | None = Field(
        None,
        description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY. Empty means the "
        "agents' ambient credentials (IRSA, instance profile).",
    )

    @model_validator(mode="after")
    def _s3_only(self) -> ModelSource:
        if not matches(S3_URI_PATTERN, self.uri):
            raise ValueError(
                "spec.model.source.uri must start with s3:// and name a bucket "
                "(s3://<bucket>/<prefix>/)"
            )
        return self


class ModelSpec(ApiModel):
    """The model weights to roll out. Any change here starts a new canary revision."""

    source: ModelSource = Field(description="Where the weights live.")
    revision: str = Field(
        description="Human label for this version of the weights (e.g. llama3-8b-2024-06-01). "
        "Shown in status and history, and set as a pod label.",
        min_length=1,
        max_length=MAX_LABEL_VALUE,
        pattern=REVISION_PATTERN,
    )
    manifest_digest: str | None = Field(
        None,
        description="Pins the sha256 of the manifest. If the manifest found at source.uri has "
        "another digest, the rollout stops with InvalidSpec.",
        pattern=SHA256_DIGEST_PATTERN,
        max_length=71,
    )


# --- prefetch, seeding, validation --------------------------------------------------------


CACHE_PATH_REMOVED = (
    "spec.prefetch.cachePath is no longer supported: the node cache directory is install-time "
    "configuration (the Helm value agent.cacheDir, given to the agents and the operator), "
    "and pods mount only their model's files; remove the field"
)
TOLERATIONS_REMOVED = (
    "spec.prefetch.tolerations is no longer supported: staging runs wherever the agent "
    "DaemonSet runs, whose tolerations are install-time configuration (the Helm value "
    "agent.tolerations); the rollout's pods take theirs from the pod template; remove the field"
)
CHUNK_SIZE_REMOVED = (
    "spec.prefetch.chunkSizeBytes is no longer supported: the chunk size is the weights "
    "manifest's, chosen when it is written (`weightship publish --chunk-size` or "
    "`weightship manifest --chunk-size`); remove the field"
)
OLD_DEFAULT_CHUNK_SIZE = 16 * MiB
"""What the CRD once defaulted chunkSizeBytes to, so every stored rollout carries it."""


class PrefetchSpec(ApiModel):
    """How node agents stage the weights onto nodes before any pod needs them."""

    enabled: bool = Field(True, description="Stage weights onto nodes before scaling the canary.")
    node_selector: LabelMap = Field(
        default_factory=dict,
        description="Nodes to stage onto (and count for minStagedPercent). Empty means the "
        "pod template's spec.nodeSelector (for workloadRef, the Deployment's), and all nodes "
        "when that is empty too; node affinity and taints are not considered. The operator "
        "publishes the result in status.prefetchNodeSelector, which the agents follow.",
    )
    # Fields a rollout once set that nothing read, or that it should not choose. Kept in
    # the schema only so admission refuses them by name rather than pruning them silently.
    # Not mirrored here, on purpose: rollouts stored before carry old values (cachePath and
    # chunkSizeBytes were defaulted on every write); CRD validation ratcheting lets them
    # keep them unchanged, and the controller ignores them, so an upgrade stops none of
    # them (docs/api.md).
    cache_path: str | None = Field(
        None,
        description="Removed: the node cache directory is install-time configuration (Helm "
        "value agent.cacheDir, given to the agents and the operator). Setting it is refused.",
        max_length=MAX_SHORT_TEXT,
        json_schema_extra=validations(
            cel("false", CACHE_PATH_REMOVED, reason="FieldValueForbidden")
        ),
    )
    tolerations: (
        list[
            Annotated[
                dict[str, Any],
                Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}),
            ]
        ]
        | None
    ) = Field(
        None,
        description="Removed: staging runs where the agent DaemonSet runs (Helm value "
        "agent.tolerations). Only an empty list is admitted.",
        max_length=32,
        json_schema_extra=validations(
            cel("size(self) == 0", TOLERATIONS_REMOVED, reason="FieldValueForbidden")
        ),
    )
    chunk_size_bytes: int | None = Field(
        None,
        description="Removed: the chunk size is the manifest's (`weightship publish "
        "--chunk-size`). Only the old default, 16777216, is admitted, and it is ignored.",
        json_schema_extra=validations(
            cel(
                f"self == {OLD_DEFAULT_CHUNK_SIZE}",
                CHUNK_SIZE_REMOVED,
                reason="FieldValueForbidden",
            )
        ),
    )
    peer_to_peer: bool = Field(
        True, description="Fetch chunks from peer nodes before the origin (S3)."
    )
    bandwidth_limit: Quantity | None = Field(
        None,
        description="Per-node download cap in bytes per second, as a quantity (e.g. 100Mi). "
        "Empty means unlimited.",
    )
    min_staged_percent: int = Field(
        100,
        description="Share of target nodes (0-100) that must have the weights staged before "
        "the canary starts. Canary pods only schedule onto staged nodes.",
        ge=0,
        le=100,
    )


class SeedingSpec(ApiModel):
    """How new replicas get their weights into GPU memory."""

    broadcast: bool = Field(
        True,
        description="Receive weights GPU-to-GPU from an already verified replica; the node "
        "cache is the fallback.",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Collective backend: nccl on GPU, gloo on CPU, auto picks."
    )
    timeout_seconds: int = Field(
        300,
        description="Give up on broadcast and read from the node cache after this.",
        ge=1,
        le=3600,
    )


EXPECT_FIELDS = ("equals", "prefix", "contains", "regex")
_EXPECT_MESSAGE = "expect must set exactly one of equals, prefix, contains or regex"


class GoldenPromptExpectation(ApiModel):
    """What the completion of a golden prompt must look like. Set exactly one field."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "[has(self.equals), has(self.prefix), has(self.contains), has(self.regex)]"
                ".filter(x, x).size() == 1",
                _EXPECT_MESSAGE,
            )
        )
    )

    equals: str | None = Field(
        None, description="The completion equals this text.", max_length=4096
    )
    prefix: str | None = Field(
        None, description="The completion starts with this text.", max_length=4096
    )
    contains: str | None = Field(
        None, description="The completion contains this text.", max_length=4096
    )
    regex: Annotated[str | None, AfterValidator(lambda v: v if v is None else check_re2(v))] = (
        Field(
            None,
            description="The completion matches this RE2 regular expression.",
            max_length=4096,
            json_schema_extra=validations(cel(RE2_VALID_RULE, "must be a valid RE2 expression")),
        )
    )

    @model_validator(mode="after")
    def _exactly_one_expectation(self) -> GoldenPromptExpectation:
        _exactly_one(self, EXPECT_FIELDS, _EXPECT_MESSAGE)
        return self


MAX_STOP_SEQUENCES = 4


class ChatMessage(ApiModel):
    """One message of a chat golden prompt."""

    role: Literal["system", "user", "assistant"] = Field(description="Who says it.")
    content: str = Field(description="What is said.", min_length=1, max_length=16384)


class GoldenPrompt(ApiModel):
    """A prompt with a known answer, sent greedily to every new replica before it may serve."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("has(self.prompt) != has(self.messages)", "set exactly one of prompt or messages")
        )
    )

    name: str = Field(
        description="Unique name, shown when the prompt fails.",
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
    )
    prompt: str | None = Field(
        None,
        description="The prompt text (on a chat endpoint: one user message).",
        min_length=1,
        max_length=16384,
    )
    messages: list[ChatMessage] | None = Field(
        None,
        description="Chat messages (chat endpoints only), instead of prompt.",
        min_length=1,
        max_length=16,
    )
    max_tokens: int = Field(16, description="Tokens to generate (1-4096).", ge=1, le=4096)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list,
        description="Stop sequences sent with the request (at most 4).",
        max_length=MAX_STOP_SEQUENCES,
    )
    expect: GoldenPromptExpectation = Field(description="What the completion must look like.")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GoldenPrompt:
        _exactly_one(self, ("prompt", "messages"), "set exactly one of prompt or messages")
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        if self.messages is not None:
            return [{"role": m.role, "content": m.content} for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def text(self) -> str:
        """The prompt as status and notifications show it."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(f"{m.role}: {m.content}" for m in self.messages or [])


class ValidationEndpoint(ApiModel):
    """The OpenAI-style endpoint of the inference container that golden prompts go to."""

    port: int = Field(8000, description="Container port.", ge=1, le=65535)
    path: str = Field(
        "/v1/completions",
        description="HTTP path: completions, or chat when it ends in /chat/completions.",
        max_length=256,
        pattern=r"^/.*$",
    )
    model: str | None = Field(
        None,
        description="The request's model field (vLLM checks it against --served-model-name).",
        max_length=256,
    )

    @property
    def chat(self) -> bool:
        return self.path.rstrip("/").endswith("/chat/completions")


ChecksumMode = Literal["auto", "loaded", "staged", "none"]
CHECKSUM_MODES: tuple[ChecksumMode, ...] = ("auto", "loaded", "staged", "none")


class ValidationSpec(ApiModel):
    """What the readiness gate weightship.io/weights-verified checks before a pod gets traffic."""

    # A CRD schema cannot validate a field that is a boolean or a string (CEL does not see
    # untyped fields), so the modes have a field of their own and checksum stays boolean.
    checksum_mode: ChecksumMode | None = Field(
        None,
        description=(
            "How the pod's weights are checked against the manifest. loaded: the server "
            "reports what it loaded (GET /weightship/v1/loaded: the reference server, the "
            "vLLM plugin). staged: the pod serves the model's folder in the node cache, "
            "which its node agent verified chunk by chunk, mounted read-only. auto (the "
            "default): loaded when the server answers that endpoint, else staged. none: "
            "no check. Overrides checksum."
        ),
    )
    checksum: bool | None = Field(
        None,
        description="Older form of checksumMode: true is loaded, false is none.",
    )
    golden_prompts: list[GoldenPrompt] = Field(
        default_factory=list,
        description="Prompts that must all pass.",
        max_length=MAX_GOLDEN_PROMPTS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    endpoint: ValidationEndpoint = Field(
        default_factory=ValidationEndpoint,
        description="Where golden prompts are sent.",
        json_schema_extra={"default": {}},
    )
    timeout_seconds: int = Field(30, description="Timeout for each check.", ge=1, le=3600)
    failure_threshold: int = Field(
        1,
        description="Canary pods that may fail verification before the rollout aborts.",
        ge=1,
        le=1000,
    )

    @property
    def mode(self) -> ChecksumMode:
        """checksumMode, else what checksum meant (true: loaded, false: none), else auto."""
        if self.checksum_mode is not None:
            return self.checksum_mode
        if self.checksum is not None:
            return "loaded" if self.checksum else "none"
        return "auto"


# --- canary strategy -------------------------------------------------------------------------


class PauseStep(ApiModel):
    """Wait. With a duration the rollout resumes by itself; without one it waits for
    `weightship promote`."""

    duration: Annotated[str | None, _duration_within(None, MAX_PAUSE)] = Field(
        None,
        description="Go-style duration such as 30s, 5m or 1h30m, at most "
        f"{MAX_PAUSE}. Empty waits for promote.",
        max_length=64,
        pattern=DURATION_PATTERN,
        json_schema_extra=_duration_rule(None, MAX_PAUSE),
    )


class AnalysisStep(ApiModel):
    """Measure canary metrics and block until they pass (an inconclusive result pauses)."""

    metrics: list[Annotated[str, Field(max_length=63)]] = Field(
        default_factory=list,
        description="Names of spec.strategy.canary.analysis.metrics to run. Empty runs all.",
        max_length=16,
    )


_STEP_MESSAGE = "each step must set exactly one of setWeight, pause or analysis"


class CanaryStep(ApiModel):
    """One step of the canary. Set exactly one of setWeight, pause or analysis."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "[has(self.setWeight), has(self.pause), has(self.analysis)]"
                ".filter(x, x).size() == 1",
                _STEP_MESSAGE,
            )
        )
    )

    set_weight: int | None = Field(
        None,
        description="Percentage of replicas (or HTTPRoute traffic) on the canary, 0-100.",
        ge=0,
        le=100,
    )
    pause: PauseStep | None = Field(None, description="Wait for a duration or for promote.")
    analysis: AnalysisStep | None = Field(None, description="Run metrics as a blocking gate.")

    @model_validator(mode="after")
    def _exactly_one_action(self) -> CanaryStep:
        _exactly_one(self, ("set_weight", "pause", "analysis"), _STEP_MESSAGE)
        return self


class PrometheusProvider(ApiModel):
    """A Prometheus server to query."""

    address: str = Field(
        description="Base URL, e.g. http://prometheus.monitoring:9090.",
        max_length=MAX_SHORT_TEXT,
        pattern=URL_PATTERN,
    )


_BOUNDS_MESSAGE = "metric must set min, max or both"
# Every {{ of a query opens a known variable: one regex over the query (a findAll over
# its placeholders costs the API server's CEL budget 100 times over). Stricter than
# api.promql, never looser: a {{ that is no variable is refused too. The space class is
# Python's str \s (api.promql's placeholder), spelled out: RE2's \s is ASCII only.
_SPACE = (
    r"[\t\n\x{0b}\f\r \x{1c}-\x{1f}\x{85}\x{a0}\x{1680}\x{2000}-\x{200a}"
    r"\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}]*"
)
QUERY_PATTERN = (
    r"^([^{]|\{[^{]|\{\{" + _SPACE + "(" + "|".join(QUERY_VARIABLES) + ")" + _SPACE + r"\}\})*\{?$"
)
_QUERY_VARIABLES_RULE = f"self.matches(r'{QUERY_PATTERN}')"
_QUERY_VARIABLES_MESSAGE = "every {{ }} of the query must name a variable: " + ", ".join(
    QUERY_VARIABLES
)
_ORDER_MESSAGE = "metric min must not exceed max"


class Metric(ApiModel):
    """A PromQL query whose result must stay within [min, max]."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("has(self.min) || has(self.max)", _BOUNDS_MESSAGE),
            cel("!has(self.min) || !has(self.max) || self.min <= self.max", _ORDER_MESSAGE),
        )
    )

    name: str = Field(description="Unique metric name.", max_length=63, pattern=DNS_LABEL_PATTERN)
    query: str = Field(
        description="PromQL returning one number. Variables: {{ namespace }}, {{ rollout }}, "
        "{{ canaryRevision }}, {{ stableRevision }}, {{ canaryHash }}, {{ stableHash }}, "
        "{{ interval }}.",
        min_length=1,
        max_length=8192,
        json_schema_extra=validations(cel(_QUERY_VARIABLES_RULE, _QUERY_VARIABLES_MESSAGE)),
    )
    min: float | None = Field(None, description="Lowest passing value (inclusive).")
    max: float | None = Field(None, description="Highest passing value (inclusive).")
    interval: Annotated[str, _duration_within(MIN_INTERVAL, MAX_INTERVAL)] = Field(
        "30s",
        description=f"Time between measurements ({MIN_INTERVAL} to {MAX_INTERVAL}).",
        max_length=64,
        pattern=DURATION_PATTERN,
        json_schema_extra=_duration_rule(MIN_INTERVAL, MAX_INTERVAL),
    )
    count: int = Field(
        1, description="Measurements to take before the metric passes.", ge=1, le=1000
    )
    failure_limit: int = Field(
        0, description="Failed measurements tolerated; one more fails the metric.", ge=0, le=1000
    )
    inconclusive_limit: int = Field(
        0,
        description="Inconclusive measurements tolerated; one more pauses the rollout.",
        ge=0,
        le=1000,
    )
    consecutive_error_limit: int = Field(
        4,
        description="Query errors in a row tolerated. Beyond it the provider is taken as "
        "unreachable: the rollout pauses (never promotes) and resumes when a query succeeds.",
        ge=0,
        le=1000,
    )
    no_data_policy: Literal["Inconclusive", "Fail", "Pass"] = Field(
        "Inconclusive",
        description="How an empty or NaN result counts: Inconclusive (pauses once over "
        "inconclusiveLimit), Fail, or Pass.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> Metric:
        if self.min is None and self.max is None:
            raise ValueError(_BOUNDS_MESSAGE)
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(_ORDER_MESSAGE)
        unknown = placeholders(self.query) - set(QUERY_VARIABLES)
        if unknown:
            raise ValueError(
                f"metric {self.name} query uses unknown variables {sorted(unknown)}; "
                f"known: {', '.join(QUERY_VARIABLES)}"
            )
        return self


class CanaryAnalysis(ApiModel):
    """Metrics that analysis steps can run."""

    prometheus: PrometheusProvider = Field(description="Where to query.")
    metrics: list[Metric] = Field(
        description="The metrics.",
        min_length=1,
        max_length=MAX_METRICS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class HTTPRouteRef(ApiModel):
    """A Gateway API HTTPRoute."""

    name: str = Field(description="Name of the HTTPRoute.", min_length=1, max_length=MAX_NAME)
    namespace: str | None = Field(
        None, description="Namespace of the HTTPRoute; defaults to the rollout's.", max_length=63
    )


_BACKENDS_MESSAGE = "gatewayAPI.stableBackend and gatewayAPI.canaryBackend must differ"


class GatewayAPIRouting(ApiModel):
    """Split traffic by weighting two Service backends of an HTTPRoute rule."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("self.stableBackend != self.canaryBackend", _BACKENDS_MESSAGE)
        )
    )

    http_route: HTTPRouteRef = Field(description="The HTTPRoute whose backend weights are set.")
    stable_backend: str = Field(
        description="Service selecting stable pods.", min_length=1, max_length=63
    )
    canary_backend: str = Field(
        description="Service selecting canary pods.", min_length=1, max_length=63
    )

    @model_validator(mode="after")
    def _distinct_backends(self) -> GatewayAPIRouting:
        if self.stable_backend == self.canary_backend:
            raise ValueError(_BACKENDS_MESSAGE)
        return self


class ReplicaRatioRouting(ApiModel):
    """Approximate the weight by the share of canary pods behind one Service (no router)."""


_ROUTING_MESSAGE = "trafficRouting may set replicaRatio or gatewayAPI, not both"


class TrafficRouting(ApiModel):
    """How canary weight becomes traffic. Empty means replicaRatio."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("!(has(self.replicaRatio) && has(self.gatewayAPI))", _ROUTING_MESSAGE)
        )
    )

    replica_ratio: ReplicaRatioRouting | None = Field(
        None, description="Weight by replica count (the default)."
    )
    gateway_api: GatewayAPIRouting | None = Field(
        None, alias="gatewayAPI", description="Weight by Gateway API HTTPRoute backend weights."
    )

    @model_validator(mode="after")
    def _one_router(self) -> TrafficRouting:
        if self.replica_ratio is not None and self.gateway_api is not None:
            raise ValueError(_ROUTING_MESSAGE)
        return self


UpdatePolicy = Literal["Recreate", "InPlaceIfPossible"]


MAX_UNAVAILABLE_PATTERN = r"^(100|[1-9]?[0-9])%$"
_MAX_UNAVAILABLE_MESSAGE = (
    "must be a count of at least 0 or a percent from 0% to 100% of spec.replicas (0: every "
    "swap keeps its pod in traffic, its server holding requests)"
)


def _check_max_unavailable(value: int | str) -> int | str:
    if isinstance(value, bool) or (isinstance(value, int) and value < 0):
        raise ValueError(_MAX_UNAVAILABLE_MESSAGE)
    if isinstance(value, str) and not matches(MAX_UNAVAILABLE_PATTERN, value):
        raise ValueError(_MAX_UNAVAILABLE_MESSAGE)
    return value


# A Deployment's maxUnavailable: how many pods may leave traffic for their swaps (0: none
# does; each swaps in traffic, its server holding requests).
MaxUnavailable = Annotated[
    int | str,
    AfterValidator(_check_max_unavailable),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "maxLength": 4,
            "x-kubernetes-int-or-string": True,
            **validations(
                cel(
                    "type(self) == int ? self >= 0 : "
                    f"string(self).matches(r'{MAX_UNAVAILABLE_PATTERN}')",
                    _MAX_UNAVAILABLE_MESSAGE,
                )
            ),
        }
    ),
]


class InPlaceUpdate(ApiModel):
    """How a running replica takes new weights without a restart (updatePolicy
    InPlaceIfPossible): it leaves traffic (or, where that would leave too few serving, its
    server holds requests), drains, swaps verified weights, and is verified again before
    it serves."""

    max_unavailable: MaxUnavailable = Field(
        "25%",
        description="How many pods may be out of traffic at once for their swaps and the "
        "checks after them: a count, or a percent of spec.replicas rounded down (a percent "
        "above 0% to at least 1), as a Deployment's maxUnavailable. Pods already out of "
        "traffic count against it. A pod whose leaving would break the bound (0) or leave no "
        "pod serving (one replica) swaps in traffic instead, one at a time: it stays in the "
        "Service and its server holds requests until verified weights answer them.",
    )
    max_hold_seconds: int = Field(
        60,
        description="Longest a request waits at a swapping pod's server (through the swap "
        "and the checks after it) before it is answered 503 (reason HoldTimeout) instead.",
        ge=1,
        le=3600,
    )

    drain_timeout_seconds: int = Field(
        30,
        description="How long a pod that has left traffic waits for its in-flight requests "
        "before its weights are swapped; requests still running then are aborted.",
        ge=0,
        le=3600,
    )
    swap_timeout_seconds: int = Field(
        300,
        description="A swap not finished this long after it began fails: the pod stays out "
        "of traffic until it is swapped back to the stable weights or restarted.",
        ge=10,
        le=3600,
    )


_ANALYSIS_DEFINED_MESSAGE = "spec.strategy.canary.analysis must be set when a step uses analysis"
_METRIC_KNOWN_MESSAGE = (
    "analysis steps may only name metrics defined in spec.strategy.canary.analysis.metrics"
)


class CanaryStrategy(ApiModel):
    """Step-by-step canary in the Argo Rollouts vocabulary.

    The stable ReplicaSet keeps its full size while the canary grows (like Argo Rollouts with
    dynamicStableScale: false), so an abort never has to wait for GPUs to come back."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!self.steps.exists(s, has(s.analysis)) || has(self.analysis)",
                _ANALYSIS_DEFINED_MESSAGE,
                field_path=".analysis",
                reason="FieldValueRequired",
            ),
            cel(
                "self.steps.all(s, !has(s.analysis) || !has(s.analysis.metrics) || "
                "s.analysis.metrics.all(m, has(self.analysis) && "
                "self.analysis.metrics.exists(d, d.name == m)))",
                _METRIC_KNOWN_MESSAGE,
                field_path=".steps",
            ),
        )
    )

    steps: list[CanaryStep] = Field(
        description="Steps, run in order. After the last one the canary is promoted to stable.",
        min_length=1,
        max_length=MAX_STEPS,
    )
    analysis: CanaryAnalysis | None = Field(None, description="Metrics for analysis steps.")
    traffic_routing: TrafficRouting | None = Field(
        None, description="How weight becomes traffic. Empty means replicaRatio."
    )
    progress_deadline_seconds: int = Field(
        600,
        description="Abort when prefetch or a setWeight step makes no progress for this long. "
        "Pauses and analysis do not count.",
        ge=1,
        le=86400,
    )
    abort_scale_down_delay_seconds: int = Field(
        30,
        description="After an abort, once the stable ReplicaSet is Ready again, wait this long "
        "before scaling the canary to zero. With replicaRatio routing its pods leave the "
        "Service's endpoints at once and drain meanwhile. 0 scales it down once they left.",
        ge=0,
        le=86400,
    )
    scale_down_delay_seconds: int = Field(
        30,
        description="Pods are out of traffic this long before they are deleted. With "
        "gatewayAPI routing the old stable is kept this long at weight 0 after a promotion. "
        "With replicaRatio every pod a scale-down removes (an old stable, a dropped canary, "
        "fewer replicas) first leaves the Service's endpoints (its weights-verified gate "
        "goes False) and is deleted this long after; its own preStop hook and grace period "
        "still run then.",
        ge=0,
        le=86400,
    )

    update_policy: UpdatePolicy = Field(
        "Recreate",
        description="Recreate: every revision gets new pods. InPlaceIfPossible: when only "
        "spec.model changed, running pods swap to the new weights in place (the inference "
        "server must support it: the weightship vLLM plugin does); any other change of the "
        "pod template still replaces pods.",
    )
    in_place: InPlaceUpdate = Field(
        default_factory=InPlaceUpdate,
        description="Drain and swap limits of in-place updates.",
    )

    @model_validator(mode="after")
    def _analysis_references(self) -> CanaryStrategy:
        analysis_steps = [s.analysis for s in self.steps if s.analysis is not None]
        if analysis_steps and self.analysis is None:
            raise ValueError(_ANALYSIS_DEFINED_MESSAGE)
        known = {m.name for m in self.analysis.metrics} if self.analysis else set()
        for step in analysis_steps:
            if not set(step.metrics) <= known:
                raise ValueError(_METRIC_KNOWN_MESSAGE)
        return self

    @property
    def uses_gateway_api(self) -> bool:
        return self.traffic_routing is not None and self.traffic_routing.gateway_api is not None


class Strategy(ApiModel):
    """How a new revision replaces the stable one."""

    canary: CanaryStrategy = Field(description="Step-by-step canary.")


class SlackNotification(ApiModel):
    """Post rollout events to a Slack incoming webhook."""

    webhook_secret_ref: SecretKeyRef = Field(
        description="Secret key holding the incoming-webhook URL (key defaults to url)."
    )
    channel: str | None = Field(
        None, description="Channel override, e.g. #ml-oncall.", max_length=80
    )
    events: list[NotificationEvent] = Field(
        default_factory=lambda: list(DEFAULT_SLACK_EVENTS),
        description="Events to post: Promoted, RolledBack, Paused, Failed, StepCompleted.",
        max_length=len(NOTIFICATION_EVENTS),
        json_schema_extra={
            "x-kubernetes-list-type": "set",
            "default": ["Promoted", "RolledBack", "Failed"],
        },
    )


class Notifications(ApiModel):
    """Where rollout events are announced."""

    slack: SlackNotification | None = Field(None, description="Slack incoming webhook.")


_WORKLOAD_MESSAGE = "exactly one of spec.template or spec.workloadRef must be set"
_SELECTOR_MESSAGE = "spec.selector.matchLabels must match spec.template.metadata.labels"


class ModelRolloutSpec(ApiModel):
    """The desired inference fleet: its pods, its weights and how new weights roll out."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("has(self.template) != has(self.workloadRef)", _WORKLOAD_MESSAGE),
            cel(
                "!has(self.template) || self.selector.matchLabels.all(k, "
                "has(self.template.metadata) && has(self.template.metadata.labels) && "
                "k in self.template.metadata.labels && "
                "self.template.metadata.labels[k] == self.selector.matchLabels[k])",
                _SELECTOR_MESSAGE,
                field_path=".selector",
            ),
        )
    )

    replicas: int = Field(
        1, description="Inference replicas when no rollout is running.", ge=0, le=100000
    )
    selector: LabelSelector = Field(description="Label selector of the inference pods.")
    template: PodTemplate | None = Field(
        None, description="Pod template of the inference pods. Exclusive with workloadRef."
    )
    workload_ref: WorkloadRef | None = Field(
        None, description="Take the pod template from an existing Deployment instead."
    )
    model: ModelSpec = Field(description="The weights to serve.")
    prefetch: PrefetchSpec = Field(
        default_factory=PrefetchSpec,
        description="Staging of weights onto nodes.",
        json_schema_extra={"default": {}},
    )
    seeding: SeedingSpec = Field(
        default_factory=SeedingSpec,
        description="Loading of weights into new replicas.",
        json_schema_extra={"default": {}},
    )
    validation: ValidationSpec = Field(
        default_factory=ValidationSpec,
        description="Checks behind the readiness gate weightship.io/weights-verified.",
        json_schema_extra={"default": {}},
    )
    strategy: Strategy = Field(description="Rollout strategy.")
    notifications: Notifications | None = Field(None, description="Where events are announced.")

    @model_validator(mode="after")
    def _workload_source(self) -> ModelRolloutSpec:
        if (self.template is None) == (self.workload_ref is None):
            raise ValueError(_WORKLOAD_MESSAGE)
        if self.template is not None:
            labels = self.template.metadata.labels
            if any(labels.get(k) != v for k, v in self.selector.match_labels.items()):
                raise ValueError(_SELECTOR_MESSAGE)
        return self
