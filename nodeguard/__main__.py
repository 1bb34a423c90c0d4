from nodeguard.surfaces.cli import main

raise SystemExit(main())
