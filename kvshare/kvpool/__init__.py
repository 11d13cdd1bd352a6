"""The shared pool: chunk keys (`keys`), the page slot format (`page`), the arena
(`arena`), the daemon's index (`index`) and server (`daemon`, `protocol`), the client
(`client`), and the connector that moves KV between engine blocks and pages."""
