"""What `compress serve --engine ray` is asked for beyond the other engines: how many
replicas (a fixed number, or autoscaled between two), what each asks of the cluster (CPUs,
custom resources), and which cluster (`address`; None: a local one compress starts).

Ray-free: the command line checks these before anything starts, with any engine."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from compress.errors import UserError

DOWNSCALE_DELAY_S = 600.0  # Ray Serve's own default
UPSCALE_DELAY_S = 2.0  # a load seen this long adds replicas (Ray Serve's default: 30 s)
ONGOING_BATCHES = 2  # a replica holds one batch running and the next forming, no more


@dataclass(frozen=True)
class RayOptions:
    """The Ray engine's options (None or empty: not given on the command line)."""

    replicas: int | None = None
    autoscale: tuple[int, int] | None = None
    downscale_delay_s: float | None = None
    cpus_per_replica: float | None = None
    replica_resources: dict[str, float] = field(default_factory=dict)
    address: str | None = None

    def given(self) -> list[str]:
        """The command line's names of the options given."""
        names = {"replicas": "--replicas", "autoscale": "--autoscale",
                 "downscale_delay_s": "--downscale-delay",
                 "cpus_per_replica": "--cpus-per-replica",
                 "replica_resources": "--replica-resources", "address": "--address"}
        return [flag for key, flag in names.items() if getattr(self, key) not in (None, {})]

    def check(self) -> None:
        """A UserError for options that contradict each other."""
        if self.replicas is not None and self.autoscale is not None:
            raise UserError("--replicas and --autoscale MIN,MAX contradict each other: give one")
        if self.downscale_delay_s is not None and self.autoscale is None:
            raise UserError("--downscale-delay applies to --autoscale MIN,MAX: give both")

    def most_replicas(self) -> int:
        return self.autoscale[1] if self.autoscale else (self.replicas or 1)

    def record(self) -> dict[str, Any]:
        """As server.json and the keeper process read it."""
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RayOptions:
        autoscale = record.get("autoscale")
        return cls(**{**record, "autoscale": tuple(autoscale) if autoscale else None})


def parse_autoscale(text: str | None) -> tuple[int, int] | None:
    """`--autoscale MIN,MAX` as (MIN, MAX); a UserError unless 0 <= MIN <= MAX, MAX >= 1."""
    if text is None:
        return None
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--autoscale {text!r}: expected MIN,MAX replicas, e.g. 1,4") from None
    if not 0 <= low <= high or high < 1:
        raise UserError(f"--autoscale {text!r}: expected 0 <= MIN <= MAX and MAX >= 1")
    return low, high


def parse_resources(text: str | None) -> dict[str, float]:
    """`--replica-resources '{"name": amount}'`: the custom Ray resources each replica asks
    for (e.g. one of a slot each node offers, to place one replica a node)."""
    if not text:
        return {}
    try:
        resources = json.loads(text)
    except ValueError:
        resources = None
    if not isinstance(resources, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v) and v > 0 for k, v in resources.items()):
        raise UserError(f"--replica-resources {text!r}: expected a JSON object of positive "
                        f"amounts, e.g. '{{\"replica_slot\": 1}}'")
    return {k: float(v) for k, v in resources.items()}


def deployment_options(options: RayOptions, batch_size: int,
                       threads: int) -> dict[str, Any]:
    """Ray Serve's options for the archive's deployment: its replicas (or autoscaling on
    ongoing requests, a replica's target being one full batch), what each asks for, and
    how many requests each holds at once: two batches (`batch_size`: a continuous LM's
    decode rows). More would keep requests queued on a busy replica while another is idle:
    Ray's proxy sends to the replicas of its own node until they are full."""
    actor: dict[str, Any] = {"num_cpus": (options.cpus_per_replica
                                          if options.cpus_per_replica is not None
                                          else float(threads))}
    if options.replica_resources:
        actor["resources"] = dict(options.replica_resources)
    result: dict[str, Any] = {"ray_actor_options": actor,
                              "max_ongoing_requests": ONGOING_BATCHES * max(1, batch_size)}
    if options.autoscale:
        low, high = options.autoscale
        result["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1),
            "target_ongoing_requests": max(2, batch_size),
            "upscale_delay_s": UPSCALE_DELAY_S,
            "downscale_delay_s": (options.downscale_delay_s
                                  if options.downscale_delay_s is not None
                                  else DOWNSCALE_DELAY_S)}
    else:
        result["num_replicas"] = options.replicas or 1
    return result
