"""Statistics (per engine, typed per tier) and their Prometheus exporter."""
