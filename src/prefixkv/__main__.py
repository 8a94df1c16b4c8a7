from prefixkv.tools.cli import main

raise SystemExit(main())
