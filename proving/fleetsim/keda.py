"""KEDA's and the HPA's arithmetic, as Kubernetes' controllers do it.

Deployment mode: KEDA serves the queue's depth as an external metric of type
AverageValue, and the HPA, every sync period:

1. desired = ceil(metric / target), unless metric / (target × current) is within the
   tolerance of 1 (then: current);
2. stabilizes it: the lowest desire of the scale-up window, the highest of the
   scale-down window, bound the current count (each window's recommendations are
   the desires recorded at each sync, this one's included);
3. limits the change by the behavior's policies: over each policy's period, from the
   replicas at the period's start (now's less what was added, plus what was removed in
   it): a Pods policy allows that many more or fewer, a Percent one ceil(start × (1 +
   p/100)) up or floor(start × (1 − p/100)) down, and `selectPolicy: Max` takes the one
   allowing the most change; then min and max replicas.

Job mode (ScaledJob, default scaling strategy): at each polling interval, the Jobs to
start are min(ceil(metric / target), max) less the Jobs still running (pending ones
included), never above max in all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from proving.fleetsim.model import Behavior, Keda


def desired_replicas(metric: float, target: int, current: int, tolerance: float) -> int:
    if current > 0 and abs(metric / (target * current) - 1) <= tolerance:
        return current
    return math.ceil(metric / target)


def changed_within(events: list[tuple[float, int]], now: float, period_s: float) -> int:
    """Replicas changed by the scale events of the last `period_s`."""
    return sum(n for at, n in events if at > now - period_s)


def policy_limit(
    rule: Behavior,
    current: int,
    now: float,
    events: tuple[list[tuple[float, int]], list[tuple[float, int]]],
    *,
    up: bool,
) -> int:
    """The most (`up`) or fewest replicas the behavior's policies allow now, from the
    replicas at the start of each policy's period; `events`: the (ups, downs) so far."""
    ups, downs = events
    start = current - changed_within(ups, now, rule.period_s)
    start += changed_within(downs, now, rule.period_s)
    sign = 1 if up else -1
    limits = []
    if rule.pods:
        limits.append(start + sign * rule.pods)
    if rule.percent:
        share = start * (1 + sign * rule.percent / 100)
        limits.append(math.ceil(share) if up else int(share))
    if not limits:
        return current
    return max(limits) if up else min(limits)


@dataclass
class Hpa:
    """The HPA of a ScaledObject: its recorded desires and scale events."""

    keda: Keda
    desires: list[tuple[float, int]] = field(default_factory=list)
    ups: list[tuple[float, int]] = field(default_factory=list)
    downs: list[tuple[float, int]] = field(default_factory=list)

    def replicas(self, now: float, current: int, metric: float) -> int:
        """The replica count this sync sets."""
        k = self.keda
        desired = desired_replicas(metric, k.queue_length, current, k.tolerance)
        self.desires.append((now, desired))
        keep_s = max(k.scale_up.window_s, k.scale_down.window_s, k.scale_up.period_s)
        self.desires = [(at, d) for at, d in self.desires if at > now - keep_s]
        up = min(d for at, d in self.desires if at > now - k.scale_up.window_s or at == now)
        down = max(d for at, d in self.desires if at > now - k.scale_down.window_s or at == now)
        wanted = min(max(current, up), down)
        events = (self.ups, self.downs)
        if wanted > current:
            limit = policy_limit(k.scale_up, current, now, events, up=True)
            wanted = min(wanted, max(limit, current), k.max_replicas)
        elif wanted < current:
            limit = policy_limit(k.scale_down, current, now, events, up=False)
            wanted = max(wanted, min(limit, current), k.min_replicas)
        wanted = min(max(wanted, k.min_replicas), k.max_replicas)
        self._record(now, wanted - current)
        return wanted

    def _record(self, now: float, change: int) -> None:
        period_s = max(self.keda.scale_up.period_s, self.keda.scale_down.period_s)
        if change > 0:
            self.ups.append((now, change))
        elif change < 0:
            self.downs.append((now, -change))
        self.ups = [(at, n) for at, n in self.ups if at > now - period_s]
        self.downs = [(at, n) for at, n in self.downs if at > now - period_s]


def jobs_to_start(keda: Keda, metric: float, running: int) -> int:
    """A ScaledJob's poll (default strategy): Jobs to start now."""
    most = min(math.ceil(metric / keda.queue_length), keda.max_replicas)
    return max(0, min(most - running, keda.max_replicas - running))
