"""First-party i3core plugins, loaded through the ``i3core`` entry-point group like any other."""
