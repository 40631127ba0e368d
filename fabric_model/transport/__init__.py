"""How the processes talk: the control-plane protocol and channels, addresses, the
rendezvous store and the collectives (docs/architecture.md, "The protocol")."""
