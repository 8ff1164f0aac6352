"""The `kimiserve` command, above the services it starts, drives and measures (docs/architecture.md#floors)."""
