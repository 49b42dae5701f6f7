"""The Settings page: simulated profile, remote engine, chart refresh, CPU ranks."""
