"""Service plumbing the three services share: running a gRPC server, its config fields, channels, status
mapping, membership announcements and proto <-> engine conversions."""
