"""What the leading planner serves over HTTP besides /metrics: the admin API."""
