"""The path of one collective call, from the user's arguments to its
statistics: the communicator's settings, one line each, and the MPILOSSY_*
environment (config, environment), the call's arguments resolved (spec),
its buffers (buffers, device), the channel the core runs on (channel), and
what the call reports (stats, contributors, trace, failure).  Internal: the
public names are re-exported by mpilossy."""
