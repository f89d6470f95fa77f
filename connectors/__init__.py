"""Everything that plugs into vLLM's KV-connector API; `connectors.registry` is the public
surface. Nothing is imported here: `connectors.config` is read by Tandem's config parser, which
must not pull in vLLM."""
