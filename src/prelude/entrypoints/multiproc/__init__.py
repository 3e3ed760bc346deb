"""`prelude serve --api-server-count N`: N HTTP processes over one engine process."""
