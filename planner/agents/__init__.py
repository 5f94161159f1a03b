"""Nomad and Consul I/O and the state store: the only users of the client libraries."""
