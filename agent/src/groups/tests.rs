//! Unit tests of the groups' logic: views, placement, the handoff counts.

use super::*;

fn pb(port: u32, contact: &str, members: &[&str]) -> pb::Group {
    pb::Group {
        port,
        contact: contact.into(),
        members: members.iter().map(|m| m.to_string()).collect(),
        ..Default::default()
    }
}

#[test]
fn a_group_names_the_field_it_is_refused_for() {
    let field = |g: pb::Group| match Group::new_from_pb(&g) {
        Err(GroupsError::Invalid { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(field(pb(0, "n1", &["n2"])), "group.port");
    assert_eq!(field(pb(70000, "n1", &["n2"])), "group.port");
    assert_eq!(field(pb(80, "", &["n2"])), "group.contact");
    assert_eq!(field(pb(80, "n1", &["n2", "n2"])), "group.members");
    assert_eq!(field(pb(80, "n1", &["n1"])), "group.members");
    assert_eq!(field(pb(80, "n1", &[""])), "group.members");
}

#[test]
fn a_failed_contact_node_gives_way_to_its_first_backup() {
    let g = Group::from_pb(&pb::Group {
        port: 80,
        contact: "n1".into(),
        backups: vec!["n2".into(), "n3".into()],
        members: vec!["n4".into()],
        epoch: 0,
        placement: String::new(),
    })
    .unwrap();
    assert_eq!(g.members, ["n1", "n4", "n2", "n3"]);
    assert_eq!(g.chain(), ["n1", "n2", "n3"]);
    assert_eq!(g.epoch, 1);
    let after = g.without("n1").unwrap();
    assert_eq!((after.contact.as_str(), after.epoch), ("n2", 2));
    assert_eq!(after.backups, ["n3"]);
    assert_eq!(after.members, ["n4", "n2", "n3"]);
    let after = g.without("n2").unwrap();
    assert_eq!(
        (after.contact.as_str(), after.backups.as_slice()),
        ("n1", &["n3".to_owned()][..])
    );
    let bad = Group::from_pb(&pb::Group {
        port: 80,
        contact: "n1".into(),
        backups: vec!["n1".into()],
        members: vec!["n2".into()],
        epoch: 0,
        placement: "random".into(),
    });
    assert!(matches!(
        bad,
        Err(GroupsError::Invalid {
            field: "group.backups",
            ..
        })
    ));
}

#[test]
fn a_node_joins_as_a_member_or_at_the_end_of_the_chain_once() {
    let g = Group::from_pb(&pb(80, "n1", &["n2"])).unwrap();
    let m = g.with("n3", false).unwrap();
    assert_eq!(
        (m.members.as_slice(), m.epoch),
        (&["n1".to_owned(), "n2".into(), "n3".into()][..], 2)
    );
    assert!(m.backups.is_empty());
    assert!(m.with("n3", false).is_none(), "already a member");
    // A member becomes a backup; a backup is one already.
    let b = m.with("n3", true).unwrap();
    assert_eq!(
        (b.backups.as_slice(), b.members.len()),
        (&["n3".to_owned()][..], 3)
    );
    assert!(b.with("n3", true).is_none() && b.with("n1", true).is_none());
    let b = b.with("n4", true).unwrap();
    assert_eq!(b.chain(), ["n1", "n3", "n4"]);
    // Out and in again: at the end of the chain.
    let back = b.without("n3").unwrap().with("n3", true).unwrap();
    assert_eq!(back.chain(), ["n1", "n4", "n3"]);
    // A view after failures may hold the contact node alone; a new group
    // may not.
    let alone = Group::from_pb(&pb(80, "n1", &[])).unwrap();
    assert_eq!(alone.members, ["n1"]);
    assert!(matches!(
        Group::new_from_pb(&pb(80, "n1", &[])),
        Err(GroupsError::Invalid {
            field: "group.members",
            ..
        })
    ));
}

#[test]
fn the_contact_node_is_a_member() {
    let g = Group::from_pb(&pb(80, "n1", &["n2", "n3"])).unwrap();
    assert_eq!(g.members, ["n1", "n2", "n3"]);
    let g = Group::from_pb(&pb(80, "n2", &["n1", "n2"])).unwrap();
    assert_eq!(g.members, ["n1", "n2"]);
}

#[test]
fn a_connection_from_the_api_names_its_bad_field() {
    let c = |remote: &str, port| pb::GroupConnection {
        remote: remote.into(),
        port,
    };
    assert!(matches!(
        flow_from_pb(Some(&c("198.18.0.1", 80))),
        Err(GroupsError::Invalid {
            field: "connection.remote",
            ..
        })
    ));
    assert!(matches!(
        flow_from_pb(Some(&c("198.18.0.1:4000", 0))),
        Err(GroupsError::Invalid {
            field: "connection.port",
            ..
        })
    ));
    assert!(matches!(
        flow_from_pb(None),
        Err(GroupsError::Invalid {
            field: "connection",
            ..
        })
    ));
    let f = flow_from_pb(Some(&c("198.18.0.1:4000", 80))).unwrap();
    assert_eq!(f.to_string(), "198.18.0.1:4000 -> :80");
}

#[test]
fn a_connection_is_handed_off_once_at_a_time() {
    let f = crate::engine::destination::fixture::Fixture::new(&[]);
    let groups = &f.node.groups;
    let flow = Flow {
        remote: "198.18.0.1:4000".parse().unwrap(),
        local_port: 8080,
    };
    assert!(matches!(
        groups.begin(flow),
        Err(GroupsError::NoGroup { port: 8080, .. })
    ));
    groups.groups().insert(
        8080,
        GroupState::new(Group::from_pb(&pb(8080, "node1", &["node2"])).unwrap()),
    );
    groups.begin(flow).unwrap();
    let busy = groups.begin(flow).unwrap_err();
    assert!(matches!(busy, GroupsError::Busy { .. }));
    assert_eq!(busy.kind(), ErrorKind::Busy);
    groups.end(flow, Outcome::Given { to: "node2".into() });
    groups.begin(flow).unwrap();
    groups.end(flow, Outcome::Failed);
    let view = &groups.views()[0];
    assert_eq!((view.handoffs_given, view.handoffs_failed), (1, 1));
    assert_eq!(view.connections[0].node, "node2");
}

#[test]
fn a_process_is_managed_through_its_ancestors() {
    let me = std::process::id() as i32;
    let parent = crate::process::inspect(me).unwrap().ppid;
    assert_eq!(managed_root(&[parent], me), Some(parent));
    assert_eq!(managed_root(&[me], me), Some(me));
    assert_eq!(managed_root(&[], me), None);
}
