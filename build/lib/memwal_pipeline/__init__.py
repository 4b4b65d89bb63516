"""memwal's Dagster layer: assets, sensors, checks and the CLI over memwal_core (kept thin)."""
