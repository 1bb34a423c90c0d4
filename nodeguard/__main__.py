from nodeguard.entry import main

raise SystemExit(main())
