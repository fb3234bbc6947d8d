"""CLI: `cmfdeploy bundle | verify-artifact | import-hf | import-gguf`."""

from pipeline.stages.importers.quant_policy import add_quant_arguments, policy_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser("bundle", help="decode a verified CMF into an FP32 bundle folder")
    p.add_argument("cmf")
    p.add_argument("-o", "--output", required=True, help="bundle folder to create")
    p.add_argument("--task", help="bake this mask task (name or id) into the weights, where exact")
    p.add_argument("--skill", help="apply this skill id (its tensors replace the base's)")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.set_defaults(func=_bundle)

    p = subparsers.add_parser("verify-artifact", help="verify a stage output and its chain back to the source CMF")
    p.add_argument("artifact")
    p.add_argument("--sizes-only", action="store_true", help="check sizes, skip sha256 (fast)")
    p.add_argument("--pubkey", help="Ed25519 public key (hex, or a PEM/hex file): the artifact's manifest "
                                    "must carry a valid signature by it (manifest.json.sig)")
    p.set_defaults(func=_verify_artifact)

    for command, source, help_text, func in (
        ("import-hf", "folder", "convert a Hugging Face checkpoint folder to CMF", _import_hf),
        ("import-gguf", "file", "convert a GGUF file (llama or gemma3) to CMF", _import_gguf),
    ):
        p = subparsers.add_parser(command, help=help_text)
        p.add_argument(source)
        p.add_argument("-o", "--output", required=True)
        add_quant_arguments(p)
        p.add_argument("--force", action="store_true", help="replace an existing output")
        p.set_defaults(func=func)


def _bundle(args) -> int:
    from pipeline.stages.bundle import export_bundle

    manifest = export_bundle(args.cmf, args.output, task=args.task, skill=args.skill, force=args.force)
    print(f"{manifest.path}: {manifest['parameter_count']} parameters, "
          f"{manifest['files']['weights.safetensors']['bytes']} bytes of FP32 weights")
    return 0


def _verify_artifact(args) -> int:
    from pipeline.stages.artifacts import verify_chain
    from pipeline.stages.signing import check_manifest_signature, public_key_bytes

    # With a key, authenticity comes first: a rewritten manifest is a signature failure,
    # whatever its content would say.
    if args.pubkey is not None:
        pubkey = public_key_bytes(args.pubkey)
        signature = check_manifest_signature(args.artifact, pubkey)
    for link in verify_chain(args.artifact, hashes=not args.sizes_only):
        print(link)
        if link.checked:
            print(f"  checked: {link.checked}")
    if args.pubkey is not None:
        print(f"signature {signature}: verified, by {pubkey.hex()}")
    return 0


def _import_hf(args) -> int:
    from pipeline.stages.importers.hf import import_hf

    paths = import_hf(args.folder, args.output, policy=policy_from_args(args), force=args.force)
    print("written: " + ", ".join(map(str, paths)))
    return 0


def _import_gguf(args) -> int:
    from pipeline.stages.importers.gguf import import_gguf

    paths = import_gguf(args.file, args.output, policy=policy_from_args(args), force=args.force)
    print("written: " + ", ".join(map(str, paths)))
    return 0

