"""deploy/'s monitoring run for real: a Prometheus (Debian's package) scraping a running stack with the
deploy config's jobs and alert rules (prometheus.py), and the Grafana dashboard's queries, run and drawn
(dashboard.py). tests/test_monitoring.py and bench/dashboard_snapshot.py use them."""
