"""The scaled-out path: `medic serve --dispatch prefect` opens incidents, Prefect runs them.

The service stores, correlates and opens incidents exactly as on the warm path (switch storms,
joining running incidents and the storm hold included), and every incident it opens is
announced as `medic.incident.opened` in Prefect's event feed. The `remediate-incident`
deployment's trigger (deployments/prefect.yaml) turns that event into a flow run on the
`medic` work pool, so workers on other hosts remediate while this process only listens.
"""

from __future__ import annotations

import logging

from medic.flows.live import LiveDispatcher
from medic.incidents import Incident

log = logging.getLogger("medic.deployed")


class DeployedDispatcher(LiveDispatcher):
    async def start(self, incident: Incident) -> None:
        """Nothing to run here: the `medic.incident.opened` event already went out when it opened.

        Its run is the deployment's (Prefect retries it), so this process stops renewing the lease
        it opened the incident under; a service with `--dispatch prefect` picks up nothing."""
        self.leases.release(incident.id)
        log.info(
            "incident %s on %s opened; the deployment's trigger starts its flow run",
            incident.id,
            incident.node,
        )
