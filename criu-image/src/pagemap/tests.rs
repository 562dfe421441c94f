//! The pagemap reader and checker against images built here, field by
//! field, in every form CRIU writes.

use super::*;
use crate::image::{FILES, IMG_COMMON_MAGIC};
use crate::wire::{WireProblem, encode_len, encode_varint};

const PS: u64 = 4096;

/// A protobuf message under construction.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn varint(mut self, field: u32, v: u64) -> Self {
        encode_varint(u64::from(field) << 3, &mut self.0);
        encode_varint(v, &mut self.0);
        self
    }
    fn bytes(mut self, field: u32, b: &[u8]) -> Self {
        encode_varint(u64::from(field) << 3 | 2, &mut self.0);
        encode_len(b, &mut self.0);
        self
    }
}

pub(super) fn head(pages_id: u32) -> Vec<u8> {
    Msg::default().varint(1, u64::from(pages_id)).0
}

/// An entry as CRIU 4.2 writes it: field 2 left at 0, the count in 5.
pub(super) fn entry(vaddr: u64, nr_pages: u64, flags: u32) -> Vec<u8> {
    Msg::default()
        .varint(1, vaddr)
        .varint(2, 0)
        .varint(4, u64::from(flags))
        .varint(5, nr_pages)
        .0
}

/// An entry as CRIU before 3.5 wrote it: no flags, maybe in_parent.
pub(super) fn old_entry(vaddr: u64, nr_pages: u32, in_parent: Option<bool>) -> Vec<u8> {
    let m = Msg::default()
        .varint(1, vaddr)
        .varint(2, u64::from(nr_pages));
    match in_parent {
        Some(p) => m.varint(3, u64::from(p)).0,
        None => m.0,
    }
}

pub(super) fn image(entries: &[Vec<u8>]) -> Vec<u8> {
    let mut b = IMG_COMMON_MAGIC.to_ne_bytes().to_vec();
    b.extend(PAGEMAP_MAGIC.to_ne_bytes());
    for e in entries {
        b.extend((e.len() as u32).to_ne_bytes());
        b.extend(e);
    }
    b
}

/// Where entry `i` (0 is the head) of `image(entries)` starts its
/// payload.
fn payload_offset(entries: &[Vec<u8>], i: usize) -> u64 {
    (8 + entries[..i].iter().map(|e| 4 + e.len()).sum::<usize>() + 4) as u64
}

fn parse_with(bytes: &[u8], page_size: u64) -> Result<Pagemap, ImageError> {
    parse(Path::new("pagemap-1.img"), bytes, page_size)
}

fn parse_ok(entries: &[Vec<u8>]) -> Pagemap {
    parse_with(&image(entries), PS).unwrap()
}

/// The problem and file offset of a pagemap error.
fn problem(entries: &[Vec<u8>]) -> (PagemapProblem, u64) {
    match parse_with(&image(entries), PS) {
        Err(ImageError::BadPagemap {
            problem, offset, ..
        }) => (problem, offset),
        other => panic!("expected a pagemap error, got {other:?}"),
    }
}

fn run(vaddr: u64, nr_pages: u64, flags: u32, off: Option<u64>) -> PageRun {
    PageRun {
        vaddr,
        nr_pages,
        flags,
        pages_file_offset: off,
    }
}

/// Every kind of run CRIU 4.2 writes, with an adjacent pair and a field
/// this module does not know.
fn mixed() -> Vec<Vec<u8>> {
    let mut last = entry(0x7ffd_0000_0000, 1, PE_PRESENT);
    last.extend(Msg::default().varint(99, 7).bytes(100, b"future").0);
    vec![
        head(7),
        entry(0x40_0000, 3, PE_PRESENT),
        entry(0x40_3000, 2, PE_PARENT),
        entry(0x50_0000, 1, PE_LAZY),
        entry(0x60_0000, 2, PE_LAZY | PE_PRESENT),
        last,
    ]
}

#[test]
fn present_runs_are_laid_out_back_to_back() {
    let pm = parse_ok(&mixed());
    assert_eq!(pm.pages_id, 7);
    assert_eq!(pm.pages_file, "pages-7.img");
    assert_eq!(pm.page_size, PS);
    assert_eq!(
        pm.runs,
        [
            run(0x40_0000, 3, PE_PRESENT, Some(0)),
            run(0x40_3000, 2, PE_PARENT, None),
            run(0x50_0000, 1, PE_LAZY, None),
            run(0x60_0000, 2, PE_LAZY | PE_PRESENT, Some(3 * PS)),
            run(0x7ffd_0000_0000, 1, PE_PRESENT, Some(5 * PS)),
        ]
    );
    assert_eq!(pm.present_bytes(), 6 * PS);
    assert!(pm.runs[3].is_present() && pm.runs[3].is_lazy());
    assert!(pm.runs[1].in_parent() && !pm.runs[1].is_present());
}

#[test]
fn finds_the_run_and_offset_of_an_address() {
    let pm = parse_ok(&mixed());
    assert_eq!(pm.run_containing(0x3f_ffff), None);
    assert_eq!(pm.run_containing(0x40_0000).unwrap().vaddr, 0x40_0000);
    assert_eq!(pm.run_containing(0x40_2fff).unwrap().vaddr, 0x40_0000);
    assert_eq!(pm.run_containing(0x40_3000).unwrap().vaddr, 0x40_3000);
    assert_eq!(pm.run_containing(0x40_5000), None);
    assert_eq!(pm.run_containing(u64::MAX), None);
    assert_eq!(pm.pages_file_offset_of(0x40_2fff), Some(3 * PS - 1));
    assert_eq!(pm.pages_file_offset_of(0x40_3000), None);
    assert_eq!(pm.pages_file_offset_of(0x50_0000), None);
    assert_eq!(pm.pages_file_offset_of(0x60_1005), Some(4 * PS + 5));
    assert_eq!(pm.pages_file_offset_of(0x7ffd_0000_0fff), Some(6 * PS - 1));
    assert_eq!(pm.pages_file_offset_of(0x7ffd_0000_1000), None);
}

#[test]
fn offsets_scale_with_the_page_size() {
    let entries = [
        head(1),
        entry(0x40_0000, 3, PE_PRESENT),
        entry(0x40_c000, 2, PE_PARENT),
        entry(0x60_0000, 2, PE_LAZY | PE_PRESENT),
    ];
    let pm = parse_with(&image(&entries), 16384).unwrap();
    let offsets: Vec<_> = pm.runs.iter().map(|r| r.pages_file_offset).collect();
    assert_eq!(offsets, [Some(0), None, Some(3 * 16384)]);
    assert_eq!(pm.present_bytes(), 5 * 16384);
    assert_eq!(pm.pages_file_offset_of(0x60_4001), Some(4 * 16384 + 1));
    // 0x40_3000 is not a 16 KiB boundary.
    let entries = [head(1), entry(0x40_3000, 1, PE_PRESENT)];
    assert!(matches!(
        parse_with(&image(&entries), 16384),
        Err(ImageError::BadPagemap {
            problem: PagemapProblem::Unaligned {
                page_size: 16384,
                ..
            },
            ..
        })
    ));
}

#[test]
fn field_5_counts_when_present_field_2_otherwise() {
    let both = Msg::default()
        .varint(1, 0x1000)
        .varint(2, 9)
        .varint(4, u64::from(PE_PRESENT))
        .varint(5, 2)
        .0;
    let only_2 = Msg::default()
        .varint(1, 0x3000)
        .varint(2, 4)
        .varint(4, u64::from(PE_PRESENT))
        .0;
    let pm = parse_ok(&[head(1), both, only_2]);
    assert_eq!(
        pm.runs,
        [
            run(0x1000, 2, PE_PRESENT, Some(0)),
            run(0x3000, 4, PE_PRESENT, Some(2 * PS)),
        ]
    );
}

#[test]
fn old_images_take_their_flags_from_in_parent() {
    let lazy_in_parent = Msg::default()
        .varint(1, 0x9000)
        .varint(2, 1)
        .varint(3, 1)
        .varint(4, u64::from(PE_LAZY))
        .0;
    let pm = parse_ok(&[
        head(3),
        old_entry(0x1000, 2, None),
        old_entry(0x3000, 1, Some(true)),
        old_entry(0x4000, 3, Some(false)),
        lazy_in_parent,
        old_entry(0xa000, 1, None),
    ]);
    assert_eq!(
        pm.runs,
        [
            run(0x1000, 2, PE_PRESENT, Some(0)),
            run(0x3000, 1, PE_PARENT, None),
            run(0x4000, 3, PE_PRESENT, Some(2 * PS)),
            run(0x9000, 1, PE_PARENT | PE_LAZY, None),
            run(0xa000, 1, PE_PRESENT, Some(5 * PS)),
        ]
    );
    assert_eq!(pm.present_bytes(), 6 * PS);
}

#[test]
fn a_head_alone_is_an_empty_pagemap() {
    let pm = parse_ok(&[head(2)]);
    assert!(pm.runs.is_empty());
    assert_eq!(pm.present_bytes(), 0);
}

#[test]
fn reads_the_file_of_a_pid_in_host_pages() {
    let dir = tempfile::tempdir().unwrap();
    let entries = [
        head(5),
        old_entry(0, 2, None),
        old_entry(0x10_0000, 1, None),
    ];
    fs::write(dir.path().join("pagemap-42.img"), image(&entries)).unwrap();
    let pm = read_pagemap(dir.path(), 42).unwrap();
    let ps = pm.page_size;
    assert!(ps.is_power_of_two() && ps >= 4096);
    assert_eq!(pm.runs[1].pages_file_offset, Some(2 * ps));
    assert!(matches!(
        read_pagemap(dir.path(), 43),
        Err(ImageError::Io { op: "read", source, .. }) if source.kind() == io::ErrorKind::NotFound
    ));
}

#[test]
fn checks_the_pages_file_size() {
    let dir = tempfile::tempdir().unwrap();
    let pm = parse_ok(&mixed());
    let pages = dir.path().join("pages-7.img");
    assert!(matches!(
        pm.check_pages_file(dir.path()),
        Err(ImageError::Io { op: "stat", source, .. }) if source.kind() == io::ErrorKind::NotFound
    ));
    fs::write(&pages, vec![0u8; 6 * PS as usize]).unwrap();
    assert_eq!(pm.check_pages_file(dir.path()).unwrap(), 6 * PS);
    for len in [6 * PS - 1, 6 * PS + 1, 5 * PS, 7 * PS, 0] {
        fs::write(&pages, vec![0u8; len as usize]).unwrap();
        match pm.check_pages_file(dir.path()) {
            Err(ImageError::PagesFileSize {
                path,
                expected,
                found,
            }) => {
                assert_eq!((path, expected, found), (pages.clone(), 6 * PS, len));
            }
            other => panic!("{len} bytes: {other:?}"),
        }
    }
}

#[test]
fn rejects_another_magic_and_truncation() {
    let mut b = image(&mixed());
    b[4..8].copy_from_slice(&FILES.magic.to_ne_bytes());
    assert!(matches!(
        parse_with(&b, PS),
        Err(ImageError::BadMagic { offset: 4, .. })
    ));

    let entries = mixed();
    let full = image(&entries);
    assert!(matches!(
        parse_with(&full[..6], PS),
        Err(ImageError::Truncated { offset: 4, .. })
    ));
    // Cut inside the last entry: its size word promises more.
    let last = payload_offset(&entries, entries.len() - 1);
    assert!(matches!(
        parse_with(&full[..full.len() - 1], PS),
        Err(ImageError::Truncated { offset, .. }) if offset == last
    ));
    // Cut inside a size word.
    assert!(matches!(
        parse_with(&full[..last as usize - 2], PS),
        Err(ImageError::Truncated { offset, .. }) if offset == last - 4
    ));
    // Cut between entries: the framing cannot tell, the pages file can.
    let short = parse_with(&full[..last as usize - 4], PS).unwrap();
    assert_eq!(short.runs.len(), 4);
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("pages-7.img"), vec![0u8; 6 * PS as usize]).unwrap();
    assert!(matches!(
        short.check_pages_file(dir.path()),
        Err(ImageError::PagesFileSize { expected, found, .. })
            if expected == 5 * PS && found == 6 * PS
    ));
}

#[test]
fn rejects_a_missing_head() {
    assert_eq!(
        problem(&[]),
        (PagemapProblem::MissingHead("the image has no entries"), 8)
    );
    let entries = [entry(0x1000, 1, PE_PRESENT), entry(0x2000, 1, PE_PRESENT)];
    let (p, offset) = problem(&entries);
    assert!(matches!(p, PagemapProblem::MissingHead(_)), "{p}");
    // The tag of field 2, after the three-byte vaddr field.
    assert_eq!(offset, payload_offset(&entries, 0) + 3);
    let (p, offset) = problem(&[Msg::default().varint(9, 1).0]);
    assert!(matches!(p, PagemapProblem::MissingHead(_)), "{p}");
    assert_eq!(offset, 12);
    // A vaddr above 4 GiB does not pass for a pages_id either way.
    let entries = [Msg::default().varint(1, 0x7f00_0000_0000).0];
    assert!(matches!(
        parse_with(&image(&entries), PS),
        Err(ImageError::Protobuf {
            problem: WireProblem::Uint32OutOfRange { field: 1, .. },
            ..
        })
    ));
}

#[test]
fn rejects_runs_out_of_order() {
    // Overlapping by one page.
    let entries = [
        head(1),
        entry(0x1000, 2, PE_PRESENT),
        entry(0x2000, 1, PE_PRESENT),
    ];
    assert_eq!(
        problem(&entries),
        (
            PagemapProblem::OutOfOrder {
                vaddr: 0x2000,
                previous_end: 0x3000
            },
            payload_offset(&entries, 2)
        )
    );
    // Descending.
    let entries = [
        head(1),
        entry(0x5000, 1, PE_PARENT),
        entry(0x1000, 1, PE_PRESENT),
    ];
    assert!(matches!(
        problem(&entries).0,
        PagemapProblem::OutOfOrder {
            vaddr: 0x1000,
            previous_end: 0x6000
        }
    ));
    // The same run twice.
    let entries = [
        head(1),
        entry(0x5000, 1, PE_PRESENT),
        entry(0x5000, 1, PE_PRESENT),
    ];
    assert!(matches!(
        problem(&entries).0,
        PagemapProblem::OutOfOrder { .. }
    ));
}

#[test]
fn rejects_runs_of_zero_pages() {
    let entries = [head(1), entry(0x1000, 0, PE_PRESENT)];
    // The tag of field 5: vaddr (3 bytes), field 2 (2), flags (2).
    assert_eq!(
        problem(&entries),
        (
            PagemapProblem::ZeroPages { vaddr: 0x1000 },
            payload_offset(&entries, 1) + 7
        )
    );
    let entries = [head(1), old_entry(0x1000, 0, None)];
    assert_eq!(
        problem(&entries),
        (
            PagemapProblem::ZeroPages { vaddr: 0x1000 },
            payload_offset(&entries, 1) + 3
        )
    );
}

#[test]
fn rejects_unaligned_and_overflowing_runs() {
    let entries = [head(1), entry(0x1001, 1, PE_PRESENT)];
    assert_eq!(
        problem(&entries),
        (
            PagemapProblem::Unaligned {
                vaddr: 0x1001,
                page_size: PS
            },
            payload_offset(&entries, 1)
        )
    );
    let top = u64::MAX - (PS - 1);
    for (vaddr, nr_pages) in [(0x1000, u64::MAX), (0x1000, u64::MAX / PS), (top, 1)] {
        let (p, _) = problem(&[head(1), entry(vaddr, nr_pages, PE_PRESENT)]);
        assert!(matches!(p, PagemapProblem::RunOverflows { .. }), "{p}");
    }
    // The last page below 2^64 but one is fine.
    let pm = parse_ok(&[head(1), entry(top - PS, 1, PE_PRESENT)]);
    assert_eq!(pm.runs[0].pages_file_offset, Some(0));
}

#[test]
fn rejects_missing_required_fields() {
    let no_vaddr = Msg::default().varint(2, 1).0;
    assert_eq!(
        problem(&[head(1), no_vaddr]).0,
        PagemapProblem::MissingField {
            field: 1,
            name: "vaddr"
        }
    );
    // CRIU 4.2's reader still requires field 2 next to field 5.
    let no_compat = Msg::default().varint(1, 0x1000).varint(5, 1).0;
    assert_eq!(
        problem(&[head(1), no_compat]).0,
        PagemapProblem::MissingField {
            field: 2,
            name: "compat_nr_pages"
        }
    );
}

#[test]
fn rejects_flags_without_one_meaning() {
    for (flags, ok) in [
        (PE_PRESENT, true),
        (PE_PARENT, true),
        (PE_LAZY, true),
        (PE_LAZY | PE_PRESENT, true),
        (PE_LAZY | PE_PARENT, true),
        (0, false),
        (PE_PARENT | PE_PRESENT, false),
        (PE_PARENT | PE_PRESENT | PE_LAZY, false),
    ] {
        let r = parse_with(&image(&[head(1), entry(0x1000, 1, flags)]), PS);
        assert_eq!(r.is_ok(), ok, "flags {flags:#x}: {r:?}");
        if !ok {
            assert!(matches!(
                r,
                Err(ImageError::BadPagemap {
                    problem: PagemapProblem::ContradictoryFlags { .. },
                    ..
                })
            ));
        }
    }
    let (p, _) = problem(&[head(1), entry(0x1000, 1, PE_PRESENT | 8)]);
    assert_eq!(p, PagemapProblem::UnknownFlags { flags: 12 });
    // in_parent and PE_PRESENT together.
    let both = Msg::default()
        .varint(1, 0x1000)
        .varint(2, 1)
        .varint(3, 1)
        .varint(4, u64::from(PE_PRESENT))
        .0;
    let (p, _) = problem(&[head(1), both]);
    assert_eq!(
        p,
        PagemapProblem::ContradictoryFlags {
            vaddr: 0x1000,
            flags: PE_PARENT | PE_PRESENT
        }
    );
}

#[test]
fn rejects_fields_of_the_wrong_type_or_range() {
    let bytes_vaddr = Msg::default().bytes(1, b"x").varint(2, 1).0;
    assert!(matches!(
        parse_with(&image(&[head(1), bytes_vaddr]), PS),
        Err(ImageError::Protobuf {
            problem: WireProblem::WrongWireType { field: 1, .. },
            ..
        })
    ));
    let big_compat = Msg::default().varint(1, 0).varint(2, 1 << 32).0;
    let entries = [head(1), big_compat];
    assert!(matches!(
        parse_with(&image(&entries), PS),
        Err(ImageError::Protobuf {
            problem: WireProblem::Uint32OutOfRange { field: 2, .. },
            offset,
            ..
        }) if offset == payload_offset(&entries, 1) + 3
    ));
}

#[test]
fn garbage_never_panics() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for len in 0..300 {
        let entries: Vec<Vec<u8>> = (0..len % 7)
            .map(|_| (0..next() % 24).map(|_| next() as u8).collect())
            .collect();
        let _ = parse_with(&image(&entries), PS);
        let mut raw = image(&[]);
        raw.extend((0..len).map(|_| next() as u8));
        let _ = parse_with(&raw, PS);
    }
}
