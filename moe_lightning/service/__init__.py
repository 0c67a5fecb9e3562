"""What every service process shares: logging, error mapping, gRPC/health/metrics bootstrap."""
