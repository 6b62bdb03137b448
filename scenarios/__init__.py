"""Built-in distcheck scenarios (one per file; read by distcheck.discovery)."""
