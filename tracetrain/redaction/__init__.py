"""Personal data and secrets kept out of the store: detectors and their application to messages and tokens
(docs/architecture.md, "Redaction"). The bottom layer: the proxy, the store and exports may import it."""
