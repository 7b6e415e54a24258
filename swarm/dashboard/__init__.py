"""The swarm's status dashboard: a live web page, a JSON API and Prometheus metrics, read from the DHT.

    swarm-dashboard --initial-peers MADDR [--port 8080] [--config configs/demo.yaml | --run-id demo]
    swarm-bootstrap --dashboard-port 8080        # the same page, served by a bootstrap peer

Modules: ``peer_table`` (who is online, stale or offline, and counters summed over time), ``history``
(bounded time series for the charts), ``swarm_view`` (polls the heartbeats, builds the state),
``prometheus_metrics`` (``/metrics``), ``server`` (HTTP routes, static page), ``cli`` (``swarm-dashboard``).
The page's HTML, CSS and JS are package data under ``static/``: nothing is fetched from the internet.
"""
